"""Engine forwards over Hugging Face modules, by model family (see decoder.py)."""

from cohort.engine.models.decoder import SUPPORTED_MODEL_TYPES, DecoderForward, engine_supports

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderForward", "engine_supports"]
