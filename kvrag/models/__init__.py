"""Models: loading the embedded and local models (`loading`), the tiny random families for tests
(`tiny`), and the model and hardware fingerprints a state must match (`fingerprints`)."""

from kvrag.models.fingerprints import (
    HardwareFingerprint,
    ModelFingerprint,
    folder_weights_sha256,
    hardware_fingerprint,
    model_fingerprint,
)
from kvrag.models.loading import EMBEDDED_MODELS, LoadedModel, load_model
from kvrag.models.tiny import TINY_FAMILIES

__all__ = ["LoadedModel", "load_model", "EMBEDDED_MODELS", "TINY_FAMILIES", "ModelFingerprint", "HardwareFingerprint",
           "model_fingerprint", "hardware_fingerprint", "folder_weights_sha256"]
