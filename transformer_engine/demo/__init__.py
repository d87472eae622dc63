"""The ``te-fl demo``: a small GPT trained twice from the same weights, in high precision and in FP8."""

from .corpus import CharCorpus, generate_text
from .model import SIZES, ModelSize, TinyGPT
from .train import DemoConfig, RunResult, run_demo

__all__ = ["CharCorpus", "DemoConfig", "ModelSize", "RunResult", "SIZES", "TinyGPT", "generate_text", "run_demo"]
