"""conveyor's engine: requests, KV blocks, scheduling, model running and sampling.

The public names `conveyor.io` and `conveyor.cli` use. Re-exports torch-free names only: the engine itself
(`conveyor.core.engine`, torch) is reached through `load_engine`, which imports torch when called.
"""

from conveyor.core.config import (
                                  BACKENDS,
                                  DEFAULT_KV_CACHE_MEMORY,
                                  DEFAULT_MODEL,
                                  DEVICE_DEFAULTS,
                                  DTYPES,
                                  MIN_WAITING,
                                  EngineConfig,
                                  parse_memory,
)
from conveyor.core.errors import ConfigError, ModelLoadError
from conveyor.core.grammar import Grammars, compiling
from conveyor.core.loading import (
    check_before_loading,
    load_engine,
    load_tokenizer,
    model_report,
    resolve_engine_config,
)
from conveyor.core.model_loader import EMBEDDED_MODELS, check_model, is_embedded_cached, models_cache_dir
from conveyor.core.outputs import GenerationRequest, InFlight, ModelLimits, RequestOutput
from conveyor.core.reasoning import REASONING_PARSERS, resolve_reasoning
from conveyor.core.request import FinishReason
from conveyor.core.sampling_params import MAX_LOGPROBS, Grammar, SamplingParams
from conveyor.core.schedule_policy import SCHEDULES
from conveyor.core.schedule_types import TokenLogprobs
from conveyor.core.schema_check import schema_error
from conveyor.core.speculative import DEFAULT_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

__all__ = ["BACKENDS", "DEFAULT_KV_CACHE_MEMORY", "DEFAULT_MODEL", "DEVICE_DEFAULTS", "DTYPES", "EMBEDDED_MODELS",
           "MAX_LOGPROBS", "REASONING_PARSERS", "SCHEDULES", "SPECULATIVE_METHODS", "DEFAULT_SPECULATIVE_TOKENS", "MIN_WAITING", "resolve_reasoning", "schema_error", "ConfigError", "EngineConfig", "FinishReason", "GenerationRequest", "Grammar", "Grammars", "InFlight",
           "ModelLimits", "ModelLoadError", "RequestOutput", "SamplingParams", "check_before_loading", "check_model", "compiling",
           "is_embedded_cached",
           "load_engine", "load_tokenizer", "model_report",
           "TokenLogprobs", "models_cache_dir", "parse_memory", "resolve_engine_config"]
