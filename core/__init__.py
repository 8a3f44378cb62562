"""conveyor's engine: requests, KV blocks, scheduling, model running and sampling.

Re-exports torch-free public types only; `conveyor.core.engine` (torch) is imported explicitly.
"""

from conveyor.core.config import EngineConfig
from conveyor.core.outputs import GenerationRequest, RequestOutput
from conveyor.core.request import FinishReason
from conveyor.core.sampling_params import Grammar, SamplingParams

__all__ = ["EngineConfig", "FinishReason", "GenerationRequest", "Grammar", "RequestOutput", "SamplingParams"]
