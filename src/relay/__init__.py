"""Relay: an LLM inference engine with continuous batching, a paged KV pool and a radix prefix cache."""
from relay.config import EngineConfig
from relay.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it only when asked for, so the
    # lightweight processes (HTTP, tokenizer, scheduler) never pay for that.
    if name in ("Engine", "RequestOutput"):
        from relay import engine

        return getattr(engine, name)
    raise AttributeError(name)
