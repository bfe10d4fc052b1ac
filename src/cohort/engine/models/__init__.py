"""Engine forwards over Hugging Face modules, by model family (registry.py picks one from config.model_type)."""

from cohort.engine.models.decoder import SUPPORTED_MODEL_TYPES, DecoderForward
from cohort.engine.models.registry import build_forward, engine_supports, supported_model_types

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderForward", "build_forward", "engine_supports", "supported_model_types"]
