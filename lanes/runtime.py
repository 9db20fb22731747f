"""The one place that creates onnxruntime sessions.

`Runtime(settings)` decides the execution providers once, logs which and why, and
loads models with `runtime.session(model)`. onnxruntime silently falls back to the
CPU when a GPU provider cannot load: every session is checked, a fallback is a loud
warning under `device: auto` and a `ModelError` under `device: cuda|tensorrt`.

`choose_providers` is the pure decision; `detect_gpu` is the only part that looks
at the machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from lanes.binding import Placement, uses_io_binding
from lanes.errors import ModelError
from lanes.settings import Device, Settings
from lanes.spec import InteractiveWorkload, ModelSpec, Workload

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

_OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

# onnxruntime element types -> numpy; the ones a served model plausibly uses.
_DTYPES: dict[str, np.dtype[np.generic]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(string)": np.dtype(np.object_),
}

# ORT severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
_ORT_FATAL_ONLY = 4
CGROUP = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class GpuProbe:
    """Whether an NVIDIA GPU is really there, and the evidence either way."""

    present: bool
    evidence: str


@dataclass(frozen=True)
class ProviderChoice:
    """The execution providers every session asks for, in priority order.

    `gpu_provider` is the GPU provider a session must obtain (None: CPU only);
    `strict` turns a session that did not obtain it into a `ModelError`.
    """

    providers: tuple[str, ...]
    reason: str
    gpu_provider: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class TensorInfo:
    """One input or output of a model: symbolic dims are str (or None when unnamed)."""

    name: str
    dtype: np.dtype[np.generic] | None  # None: an element type lanes does not map
    type: str  # onnxruntime's spelling, e.g. "tensor(float)"
    shape: tuple[int | str | None, ...]

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name} {self.type} [{dims}]"


def detect_gpu() -> GpuProbe:
    """Look for a usable NVIDIA GPU: device nodes, the driver's /proc entry, nvidia-smi.

    onnxruntime-gpu lists CUDA among its providers on any machine (it describes the
    build, not the hardware), so the hardware is checked here instead.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return GpuProbe(False, f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
    nodes = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    if nodes:
        return GpuProbe(True, f"/dev/{nodes[0]} exists")
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return GpuProbe(True, f"{gpus} lists a GPU")
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            listed = None
        if listed is not None and listed.returncode == 0 and "GPU" in listed.stdout:
            return GpuProbe(True, "nvidia-smi -L lists a GPU")
    return GpuProbe(False, "no /dev/nvidia*, no /proc/driver/nvidia/gpus, no GPU from nvidia-smi")


def choose_providers(
    device: Device, available: Collection[str], gpu_present: bool
) -> ProviderChoice:
    """Decide the providers for `device`, given onnxruntime's build and the hardware.

    Pure. `auto` takes CUDA only when both the build offers it and a GPU is present,
    else the CPU; TensorRT is opt-in (`device: tensorrt`) because it builds an engine
    per input shape at first use, minutes that `auto` should not spring on anyone.
    An explicit `cuda`/`tensorrt` that cannot be honoured raises `ModelError`.
    """
    if device == "cpu":
        return ProviderChoice((CPU,), "device is cpu")
    if device == "auto":
        if not gpu_present:
            return ProviderChoice((CPU,), "device is auto and no GPU is present")
        if CUDA not in available:
            return ProviderChoice(
                (CPU,),
                "device is auto and a GPU is present, but this onnxruntime build offers no "
                f"{CUDA} (install onnxruntime-gpu)",
            )
        return ProviderChoice(
            (CUDA, CPU), f"device is auto, a GPU is present and onnxruntime offers {CUDA}", CUDA
        )
    wanted = TENSORRT if device == "tensorrt" else CUDA
    fix = "set LANES_DEVICE=auto (or cpu) to run without it"
    if not gpu_present:
        raise ModelError(f"device is {device} but no GPU is present; {fix}")
    if wanted not in available:
        offered = ", ".join(available) or "none"
        raise ModelError(
            f"device is {device} but this onnxruntime build offers no {wanted} "
            f"(it offers {offered}); install onnxruntime-gpu, or {fix}"
        )
    chain = (TENSORRT, CUDA, CPU) if wanted == TENSORRT and CUDA in available else (wanted, CPU)
    return ProviderChoice(chain, f"device is {device}", wanted, strict=True)


def describe(tensors: Sequence[ort.NodeArg]) -> dict[str, TensorInfo]:
    """Name -> TensorInfo for a session's `get_inputs()` or `get_outputs()`, in order."""
    return {
        t.name: TensorInfo(t.name, _DTYPES.get(t.type), t.type, tuple(t.shape)) for t in tensors
    }


def check_io(
    session: ort.InferenceSession,
    *,
    where: str,
    task: str,
    inputs: Collection[str] = (),
    outputs: Collection[str] = (),
) -> None:
    """Raise `ModelError` unless the session has every named input and output.

    `where` names the model (its path) in the message; the message lists what the
    model does have, so the user sees at once whether it is the wrong file.
    """
    have_in = describe(session.get_inputs())
    have_out = describe(session.get_outputs())
    missing = [f"input {n!r}" for n in inputs if n not in have_in]
    missing += [f"output {n!r}" for n in outputs if n not in have_out]
    if missing:
        raise ModelError(
            f"model {where} cannot serve task {task!r}: it has no {' and no '.join(missing)}; "
            f"its inputs: {_listing(have_in)}; its outputs: {_listing(have_out)}"
        )


def _listing(tensors: dict[str, TensorInfo]) -> str:
    return ", ".join(str(t) for t in tensors.values()) or "none"


def idle_priority_available() -> bool:
    """Whether this OS lets a thread run at idle priority (Linux's SCHED_IDLE)."""
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


def usable_cores(cgroup: Path = CGROUP, membership: Path = MEMBERSHIP) -> int:
    """The cores this process may use: its CPU affinity (where the OS has one), or
    fewer where its cgroup's CPU quota allows fewer (`cpu_quota`)."""
    if hasattr(os, "sched_getaffinity"):
        cores = max(len(os.sched_getaffinity(0)), 1)
    else:
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup, membership)
    return cores if quota is None else min(cores, quota)


def cpu_quota(cgroup: Path = CGROUP, membership: Path = MEMBERSHIP) -> int | None:
    """The CPUs' worth of time this process's cgroup may use (a container's CPU limit,
    as a pod's `resources.limits.cpu` sets it), rounded up; None when unlimited or
    unknown. A container sees every core of its node in its affinity, so without this
    onnxruntime starts a thread per node core, and those threads share the limit's
    time in throttled slices. cgroup v2's `cpu.max` of the process's own group and
    the groups above it, else v1's `cpu.cfs_quota_us` (a container's namespace
    shows its own group at the root); `membership` is /proc/self/cgroup."""
    quotas: list[int] = []
    for group in _v2_groups(cgroup, membership):
        try:
            limit, period = (group / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if limit != "max" and int(period) > 0:
            quotas.append(-(-int(limit) // int(period)))
    if not quotas:
        try:
            limit = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
            if int(limit) > 0 and int(period) > 0:
                quotas.append(-(-int(limit) // int(period)))
        except (OSError, ValueError):
            pass
    return max(min(quotas), 1) if quotas else None


def _v2_groups(cgroup: Path, membership: Path) -> list[Path]:
    """This process's cgroup v2 folder and those above it, up to the mount's root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    own = next((line[3:] for line in lines if line.startswith("0::")), "/")
    folder = cgroup / own.lstrip("/")
    return [folder, *[p for p in folder.parents if p.is_relative_to(cgroup)]]


class Runtime:
    """Creates every onnxruntime session lanes uses, on the providers chosen once.

    Built at an entry point from `Settings` and passed down. Thread-safe: sessions
    are independent, and the choice never changes after construction.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # onnxruntime's own log lines are off: every failure it logs also raises,
        # except a GPU provider that cannot load, which `session` reports itself.
        ort.set_default_logger_severity(_ORT_FATAL_ONLY)
        available = ort.get_available_providers()
        probe = GpuProbe(False, "not probed: device is cpu")
        if settings.device != "cpu":
            probe = detect_gpu()
        self.probe = probe
        self.choice = choose_providers(settings.device, available, probe.present)
        log.info(
            "onnxruntime %s will use %s: %s (%s)",
            ort.__version__,
            ", ".join(self.choice.providers),
            self.choice.reason,
            probe.evidence,
        )

    @property
    def providers(self) -> tuple[str, ...]:
        return self.choice.providers

    def room_beside(self, model: ModelSpec) -> bool:
        """Whether a second run of `model`'s session, beside one in flight, has
        hardware of its own: on a GPU yes (the device orders the runs; the host's part
        is small), on the CPU where the session's intra-op threads (onnxruntime's
        default: every core) leave a core free. Else the two runs' threads take turns
        at the cores, and neither gains."""
        if self.choice.gpu_provider is not None:
            return True
        threads = model.session.intra_op_threads or self.settings.threads
        return threads is not None and threads < usable_cores()

    def offline_threads(self, workload: Workload, backfilled: bool) -> int:
        """How many threads at idle priority run an interactive embed/infer workload's
        offline batches beside its interactive ones (`batching.offline_threads`; see
        serving/beside.py): only on the CPU, where the OS can give a thread idle
        priority; by default only where the spec runs an offline workload on it
        (`backfilled`), since its session then stops spinning between runs (a cost to
        its latency alone); 0 for an offline workload, on a GPU, and where declared so."""
        if not isinstance(workload, InteractiveWorkload):
            return 0
        declared = workload.batching.offline_threads
        possible = idle_priority_available() and self.choice.gpu_provider is None
        if declared == 0 or (declared is None and not (possible and backfilled)):
            return 0
        if not possible:
            log.warning(
                "offline_threads needs onnxruntime's CPU provider and an OS with an idle "
                "priority (Linux); offline batches take turns with interactive ones"
            )
            return 0
        return usable_cores() if declared is None else declared

    def session_options(
        self, model: ModelSpec, spin_between_runs: bool = True
    ) -> ort.SessionOptions:
        """Threads and graph optimisation from the model's `session:`, else Settings.

        Without `spin_between_runs`, threads that spin-wait (`session.spinning`) stop
        when a run ends: between runs they would burn the cores that offline runs at idle
        priority are there to use (as much as a third of two cores at 30% load here)."""
        options = ort.SessionOptions()
        threads = model.session.intra_op_threads or self.settings.threads
        if threads is None and cpu_quota() is not None:
            threads = usable_cores()  # onnxruntime's own count ignores a CPU limit
        if threads is not None:
            options.intra_op_num_threads = threads
        if model.session.inter_op_threads is not None:
            options.inter_op_num_threads = model.session.inter_op_threads
        options.graph_optimization_level = _OPTIMIZATION[model.session.graph_optimization]
        if not model.session.spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        elif not spin_between_runs:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.log_severity_level = _ORT_FATAL_ONLY
        return options

    def session(
        self, model: ModelSpec, optimized: Path | None = None, spin_between_runs: bool = True
    ) -> ort.InferenceSession:
        """Load `model.path` on the chosen providers (`spin_between_runs`: see
        `session_options`).

        With `optimized` (a path of this process's own), the first load also writes
        the optimized graph there, its weights in a file beside it, and every later
        one loads that copy without optimizing again: a large model loads in about
        half the time (no big protobuf to parse, no graph passes), which is what a
        workload's load after `idle_unload_s` waits for. The copy is only for this
        process: an optimized graph may be specific to the providers it was made
        for. A copy that cannot be loaded is removed, and the model loads as declared.

        Raises `ModelError` with the path and onnxruntime's message when it cannot
        load, and when an explicit GPU device was not obtained.
        """
        path = model.path
        if not path.is_file():
            raise ModelError(f"no model file at {path}; build it or fix models.*.path")
        if TENSORRT in self.choice.providers:
            optimized = None  # its compiled nodes cannot be saved
        if optimized is not None and optimized.is_file():
            try:
                return self._load(optimized, model, spin_between_runs, _OPTIMIZATION["disable"])
            except ModelError as err:
                log.warning("%s; loading %s instead", err, path)
                optimized.unlink(missing_ok=True)
        if optimized is None:
            return self._load(path, model, spin_between_runs)
        try:
            return self._load(path, model, spin_between_runs, save_to=optimized)
        except ModelError as err:  # the copy could not be written (a full disk?)
            optimized.unlink(missing_ok=True)
            log.warning("%s; loading it without keeping an optimized copy", err)
            return self._load(path, model, spin_between_runs)

    def _load(
        self,
        path: Path,
        model: ModelSpec,
        spin_between_runs: bool,
        level: ort.GraphOptimizationLevel | None = None,
        save_to: Path | None = None,
    ) -> ort.InferenceSession:
        options = self.session_options(model, spin_between_runs)
        if level is not None:
            options.graph_optimization_level = level
        if save_to is not None:
            options.optimized_model_filepath = str(save_to)
            weights = "session.optimized_model_external_initializers"
            options.add_session_config_entry(f"{weights}_file_name", save_to.name + ".data")
            options.add_session_config_entry(f"{weights}_min_size_in_bytes", "1024")
        try:
            session = ort.InferenceSession(
                str(path), options, providers=list(self.choice.providers)
            )
        except Exception as err:  # onnxruntime raises its own pybind classes
            raise ModelError(f"onnxruntime cannot load {path}: {err}") from err
        self._check_obtained(session, model.path)
        return session

    def binds(self, session: ort.InferenceSession) -> bool:
        """Whether runs of `session` use IO binding (the `io_binding` setting, for the
        device the session got)."""
        return uses_io_binding(self.settings.io_binding, Placement.of(session))

    def binding(self, session: ort.InferenceSession) -> Placement | None:
        """Where runs of `session` bind their outputs (`lanes.binding.run`), or None
        when they do not bind. onnxruntime binds numeric tensors only: a model with a
        string input or output, or an output that is a sequence or a map, runs unbound
        (on the same device), and says so."""
        if not self.binds(session):
            return None
        odd = [
            f"{t.name} ({t.type})"
            for t in (*session.get_inputs(), *session.get_outputs())
            if not t.type.startswith("tensor(") or t.type == "tensor(string)"
        ]
        if odd:
            log.info("%s cannot be IO-bound: runs are not", ", ".join(odd))
            return None
        return Placement.of(session)

    def _check_obtained(self, session: ort.InferenceSession, path: Path) -> None:
        wanted = self.choice.gpu_provider
        got = session.get_providers()
        if wanted is None or wanted in got:
            return
        message = (
            f"{path} asked for {wanted} but onnxruntime gave it {', '.join(got)}: the provider "
            "could not load (its CUDA/cuDNN libraries are missing or do not match this "
            f"onnxruntime {ort.__version__}; see the requirements table in onnxruntime's "
            "CUDA execution provider docs)"
        )
        if self.choice.strict:
            raise ModelError(message + "; set LANES_DEVICE=auto or cpu to accept the CPU")
        log.warning("%s; it runs on the CPU, much slower", message)
