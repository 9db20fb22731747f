"""lanes: serve models in two modes, interactive and offline, from one workloads.yaml.

Cheap to import: no onnxruntime, torch or prefect at import time.
"""

from lanes.client import AsyncClient, Client, Completion, Usage
from lanes.errors import (
    AuthError,
    DeadlineExceeded,
    HandlerError,
    InvalidInput,
    JobFailed,
    LanesError,
    ModelError,
    NotConfigured,
    NotFound,
    Overloaded,
    RequestTooLarge,
    SettingsError,
    SpecError,
    StorageError,
    Unavailable,
    UnknownWorkload,
    WrongMode,
)
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.specfile import load_spec

__all__ = [
    "AsyncClient",
    "AuthError",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "HandlerError",
    "InvalidInput",
    "JobFailed",
    "LanesError",
    "ModelError",
    "NotConfigured",
    "NotFound",
    "Overloaded",
    "RequestTooLarge",
    "Settings",
    "SettingsError",
    "Spec",
    "SpecError",
    "StorageError",
    "Unavailable",
    "UnknownWorkload",
    "Usage",
    "WrongMode",
    "load_spec",
]
