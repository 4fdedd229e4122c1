"""leanserve: an inference engine for DeepSeek-V4-architecture models that never pays for a feature that is off."""

from leanserve.llm import LLM
from leanserve.outputs import CompletionOutput, Logprob, RequestOutput
from leanserve.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
