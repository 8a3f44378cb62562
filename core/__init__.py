"""conveyor's engine: requests, KV blocks, scheduling, model running and sampling.

The public names `conveyor.io` and `conveyor.cli` use. Re-exports torch-free names only: the engine itself
(`conveyor.core.engine`, torch) is reached through `load_engine`, which imports torch when called. A model is
handed to core as a `ModelSource` (`ModelSource.of(name)`, once) or as the name the user gave.
"""

from conveyor.core.config import (
    BACKENDS,
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_MODEL,
    DEFAULT_SPECULATIVE_TOKENS,
    DEVICE_DEFAULTS,
    DTYPES,
    MIN_WAITING,
    SCHEDULES,
    SPECULATIVE_METHODS,
    EngineConfig,
    parse_memory,
)
from conveyor.core.errors import ConfigError, ModelLoadError
from conveyor.core.fields import OptionMeta, check_fields, check_value, field_kinds, option, option_fields, option_meta
from conveyor.core.grammar import Grammars, compiling
from conveyor.core.loading import (
    auto_task,
    check_before_loading,
    check_pooling_model,
    load_engine,
    load_pooling_tokenizer,
    load_tokenizer,
    model_fingerprint,
    resolve_engine_config,
)
from conveyor.core.model_check import model_report
from conveyor.core.model_loader import check_model
from conveyor.core.model_source import EMBEDDED_MODELS, ModelSource, is_embedded_cached, models_cache_dir
from conveyor.core.outputs import GenerationRequest, InFlight, ModelLimits, RequestOutput
from conveyor.core.pooling_params import (
    POOLING_METHODS,
    PoolingOptions,
    PoolingOutput,
    PoolingRequest,
    TokenSequence,
)
from conveyor.core.reasoning import REASONING_PARSERS, resolve_reasoning
from conveyor.core.request import FinishReason
from conveyor.core.sampling_params import MAX_LOGPROBS, Grammar, SamplingParams
from conveyor.core.schedule_types import TokenLogprobs
from conveyor.core.schema_check import schema_error
from conveyor.core.task import POOLING_TASKS, TASKS, Task

__all__ = ["BACKENDS", "auto_task", "DEFAULT_KV_CACHE_MEMORY", "DEFAULT_MODEL", "DEFAULT_SPECULATIVE_TOKENS", "DEVICE_DEFAULTS",
           "DTYPES", "EMBEDDED_MODELS", "MAX_LOGPROBS", "MIN_WAITING", "REASONING_PARSERS", "SCHEDULES",
           "SPECULATIVE_METHODS", "ConfigError", "EngineConfig", "FinishReason", "GenerationRequest", "Grammar",
           "Grammars", "InFlight", "ModelLimits", "ModelLoadError", "ModelSource", "OptionMeta", "POOLING_METHODS", "POOLING_TASKS", "PoolingOptions", "PoolingOutput",
           "PoolingRequest", "RequestOutput", "TASKS", "TokenSequence", "SamplingParams", "Task", "TokenLogprobs",
           "check_before_loading", "check_pooling_model", "check_fields", "check_model", "check_value", "compiling", "field_kinds", "is_embedded_cached", "load_engine", "load_pooling_tokenizer", "load_tokenizer",
           "model_fingerprint", "model_report", "models_cache_dir", "option", "option_fields", "option_meta", "parse_memory", "resolve_engine_config", "resolve_reasoning",
           "schema_error"]
