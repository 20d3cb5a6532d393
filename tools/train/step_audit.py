"""A step's device discipline and host syncs, checked on any machine (``debug.audit_devices``,
``debug.count_host_syncs``).

DESIGN.md: every tensor a step creates names its device, every tensor handed to a collective
lives on the step's compute device, and host syncs are counted and budgeted. A CPU run with
gloo hides both mistakes (gloo takes CPU tensors; a "sync" costs nothing when host and device
are one), so a GPU run would be the first to find them -- at step 0, on NCCL. This module
makes a CPU run find them instead:

- ``audit_devices``: inside the step's compute (``StepAudit.compute``) the default device is
  ``meta``, so a tensor created without naming its device cannot be used as data (its values
  do not exist); and every collective (the ``c10d`` ops, which pass through dispatch) checks
  that each tensor it is handed is on the step's device, naming the op and the tensor's
  device in one line.
- ``count_host_syncs``: a count of the operations that make the host wait for a CUDA device:
  reading a value (``item``, ``tolist``, ``int()``, a blocking copy to the host), a blocking
  copy to the device (``.to(device)``, ``torch.tensor(data, device=device)``: both wait for
  the queued kernels first; ``kernels.transfer`` copies without waiting) and the ops whose
  output size depends on values (``nonzero``, ``bincount``, ``unique``, ``repeat_interleave``
  without ``output_size``, ``masked_select``, boolean indexing). On a CPU every tensor is a
  host tensor, so the count follows which tensors *would* live on the device: the model's
  parameters and buffers, DTensors, whatever ``.to(device)`` returns (a copy here, as it is
  on a GPU), what a factory makes with a device object (``device=device``), everything a
  collective touches, and every result of an op with such an input. The host is named
  ``HOST`` or ``"cpu"`` (a device *variable* that is a CPU is the step's device, whatever it
  is on this machine). Host bookkeeping (the loader's tensors, sequence lengths) is not
  counted: it costs nothing on a GPU either; nor is a read inside the CPU-only attention
  kernels (``HOST_KERNELS``).

The counts are per step; ``host_syncs_per_micro_batch`` in the metrics row divides by the
step's micro-batches. Optimizer steps run outside (``StepAudit.compute`` covers encode,
reshard, micro-batches, backward and clipping): torch's AdamW keeps its step counter on the
host on purpose.
"""

from __future__ import annotations

import collections
import contextlib
import math
import sys

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from omniscale.kernels.transfer import HOST

aten = torch.ops.aten

# aten ops whose output size or value the host must read from the device
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
    aten.bincount.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.masked_select.default,
    aten.is_nonzero.default, aten.equal.default,
}
_MARK = "_omniscale_on_device"
_COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# Factories: a tensor they make with a ``device`` object of the step's kind is a device
# tensor; one made with ``device=HOST`` or ``device="cpu"`` (or none) is host bookkeeping.
_FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.linspace}


def _tensors(args, kwargs) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _on_device(t: torch.Tensor) -> bool:
    # a DTensor (an FSDP gradient, a TP activation) lives on its mesh's device
    return getattr(t, _MARK, False) or isinstance(t, DTensor)


def _mark(tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _MARK, True)
            except (AttributeError, RuntimeError):  # a tensor type without a __dict__
                pass


# Kernels the registry picks only for a host (kernels/registry.py): the CPU attention reads
# the sequence bounds there, where the CUDA kernels take them on the device. A read inside
# them is no sync on any device.
HOST_KERNELS = {("omniscale.kernels.reference", "by_runs"),
                ("omniscale.kernels.blocked_attention", "varlen_attention")}


def _site(depth: int = 2) -> str | None:
    """``module:line`` of the innermost frame of the project's own code (None: inside a
    host-only kernel)."""
    frame, site = sys._getframe(depth), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (module, frame.f_code.co_name) in HOST_KERNELS:
            return None
        if site is None and module.startswith("omniscale.") and module != __name__:
            site = f"{module.removeprefix('omniscale.')}:{frame.f_lineno}"
        frame = frame.f_back
    return site or "torch"


def _is_sync(func, args, kwargs) -> bool:
    if func in _DATA_DEPENDENT:
        return True
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return (kwargs or {}).get("output_size") is None
    if func is aten.index.Tensor:  # a boolean mask is a nonzero first
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, audit: StepAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a = self.audit
        inputs = _tensors(args, kwargs)
        collective = func.namespace in _COLLECTIVES
        if collective and a.check_devices:
            for t in inputs:
                if t.device.type != a.device.type:
                    raise RuntimeError(
                        f"{func}: a {t.device.type} tensor {tuple(t.shape)} handed to a "
                        f"collective; the step's device is {a.device} (NCCL takes device "
                        f"tensors only: create it with device=...)")
        tracked = collective or any(_on_device(t) for t in inputs)
        if a.count_syncs and tracked and _is_sync(func, args, kwargs):
            a.count(str(func.overloadpacket.__name__))
        try:
            out = func(*args, **(kwargs or {}))
        except (RuntimeError, NotImplementedError) as e:
            if a.check_devices and any(t.is_meta for t in inputs):
                raise RuntimeError(f"{func} at {_site(1)}: a tensor created without naming its "
                                   f"device reached it (debug.audit_devices: {e})") from None
            raise
        if tracked and a.count_syncs:
            _mark(inputs if collective else ())
            _mark(_tensors(out, None))
        return out


class _Functions(TorchFunctionMode):
    """What dispatch does not see: reads to the host, and moves onto the device."""

    _READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self, audit: StepAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.audit
        if func in self._READS and args and isinstance(args[0], torch.Tensor):
            if a.check_devices and args[0].is_meta:
                raise RuntimeError(f"{func.__name__}() at {_site(1)}: a tensor created without "
                                   f"naming its device (debug.audit_devices)")
            if _on_device(args[0]):
                a.count(func.__name__)
        elif func in _FACTORIES and isinstance(kwargs.get("device"), torch.device) \
                and kwargs["device"] is not HOST and kwargs["device"].type == a.device.type:
            if func in (torch.tensor, torch.as_tensor) and args \
                    and not isinstance(args[0], torch.Tensor):
                a.count("tensor(device)")  # host data copied with a wait for the device
            out = func(*args, **kwargs)
            _mark([out])
            return out
        elif func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            target = _to_device(args[1:], kwargs)
            blocking = not kwargs.get("non_blocking", False)
            if _is_host(target):  # to the host: a device tensor's copy waits for the device
                if _on_device(args[0]) and blocking:
                    a.count("to(host)")
            elif target is not None and target.type == a.device.type \
                    and not _on_device(args[0]):
                # a host tensor moved to the device: a copy there, so here too (the host
                # tensor stays a host tensor). Blocking, it waits for the device first.
                if blocking:
                    a.count("to(device)")
                out = func(*args, **kwargs)
                out = out.clone() if out is args[0] else out
                _mark([out])
                return out
        return func(*args, **kwargs)


def _to_device(args, kwargs) -> torch.device | str | None:
    device = kwargs.get("device")
    if device is None and args and isinstance(args[0], (str, torch.device)):
        device = args[0]
    return device if device is None or device is HOST or device == "cpu" \
        else torch.device(device)


def _is_host(device) -> bool:
    """Named as the host: ``HOST`` or the string "cpu" (a device variable that is a CPU is
    the step's device, whatever it is on this machine)."""
    return device is HOST or device == "cpu" and isinstance(device, str)


@contextlib.contextmanager
def _dtensor_exits_marked():
    """A DTensor's ``to_local()`` / ``full_tensor()`` are plain tensors on its device; they
    leave the DTensor through no op the modes see (its collectives run below them)."""
    originals = {name: getattr(DTensor, name) for name in ("to_local", "full_tensor")}

    def marked(method):
        def call(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            _mark([out])
            return out
        return call
    try:
        for name, method in originals.items():
            setattr(DTensor, name, marked(method))
        yield
    finally:
        for name, method in originals.items():
            setattr(DTensor, name, method)


class StepAudit:
    """The checks a run asked for (``debug.audit_devices``, ``debug.count_host_syncs``); off:
    ``compute`` is a no-op."""

    def __init__(self, device: torch.device, check_devices: bool = False,
                 count_syncs: bool = False) -> None:
        self.device = torch.device(device)
        self.check_devices, self.count_syncs = check_devices, count_syncs
        self.syncs: collections.Counter = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.check_devices or self.count_syncs

    def count(self, what: str) -> None:
        """One sync of kind ``what``, keyed by where the project's code asked for it (the
        first frame of ours: ``"tolist parallel.reshard:161"``), unless it happened inside a
        kernel that runs only on a host."""
        site = _site()
        if site is not None:
            self.syncs[f"{what} {site}"] += 1

    def take(self) -> dict[str, int]:
        """The syncs counted since the last call (by op), and starts a new count."""
        syncs, self.syncs = dict(self.syncs), collections.Counter()
        return syncs

    @contextlib.contextmanager
    def compute(self, model: torch.nn.Module | None = None):
        """The step's compute under the asked checks; ``model``: its parameters and buffers
        are device tensors."""
        if not self.enabled:
            yield
            return
        if model is not None and self.count_syncs:
            _mark(model.parameters())
            _mark(model.buffers())
        with contextlib.ExitStack() as stack:
            if self.count_syncs:
                stack.enter_context(_dtensor_exits_marked())
            if self.check_devices:
                stack.enter_context(torch.device("meta"))
            stack.enter_context(_Functions(self))
            stack.enter_context(_Dispatch(self))
            yield


# --- the order of collectives across ranks (tools/train/collectives.py) -----------------------

# ``OMNISCALE_RECORD_COLLECTIVES=DIR``: every rank records the collectives of its training loop
# and writes them to DIR/collectives-rank-N.json (a test's switch, like the ``debug.`` ones,
# but read from the environment: the launcher's reaches every rank).
RECORD_ENV = "OMNISCALE_RECORD_COLLECTIVES"
_P2P = {"send", "recv_", "recv_any_source_"}
_ALL_TO_ALL = {"alltoall_base_", "all_to_all_single"}
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}
_NAMED_IN = "omniscale.tools.train.collectives"


def _group_ranks(args) -> list[int]:
    """The global ranks of the op's process group (c10d ops take it boxed, functional ones by
    name: their last string argument, after a reduction's name)."""
    from torch.distributed import distributed_c10d as c10d

    for a in reversed(args):
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return c10d.get_process_group_ranks(torch.distributed.ProcessGroup.unbox(a))
        if isinstance(a, str):
            return c10d.get_process_group_ranks(c10d._resolve_process_group(a))
    return []


def _caller() -> tuple[str | None, str]:
    """(the ``collectives`` function that issued the op, or None; the innermost frame of the
    project's own code, ``module:function``)."""
    frame, named, site = sys._getframe(2), None, None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == _NAMED_IN:
            named = frame.f_code.co_name  # the outermost one: the step module's entry point
        elif site is None and module.startswith("omniscale.") and module != __name__:
            site = f"{module.removeprefix('omniscale.')}:{frame.f_code.co_name}"
        frame = frame.f_back
    return named, site or "torch"


def _describe(func, args) -> dict:
    """One collective as the ranks must agree on it: op, group and the shapes every member
    passes alike (an all-to-all's rows differ by rank: only its trailing dims must match; a
    gather's outputs exist on its root only: its inputs)."""
    op = func.overloadpacket.__name__
    ranks = _group_ranks(args)
    operand = args[1] if op == "gather_" else args[0]
    tensors = [t for t in tree_flatten(operand)[0] if isinstance(t, torch.Tensor)]
    shapes = [list(t.shape[1:] if op in _ALL_TO_ALL else t.shape) for t in tensors]
    named, site = _caller()
    call = {"op": op, "group": ranks, "shapes": shapes,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "by": named, "site": site}
    if op in _P2P:  # the peer is a rank of the group
        call["peer"] = ranks[args[2]] if ranks else args[2]
    return call


class CollectiveRecorder(TorchDispatchMode):
    """Every collective this rank issues while it is entered (the backward's too: autograd
    carries the mode), in order, with ``mark``s between steps: ``calls``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def mark(self, label: str) -> None:
        self.calls.append({"mark": label})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # let the DTensor turn the op into local ops and collectives first (a sharded
            # norm's reduction), which come back here (as torch's CommDebugMode does)
            return NotImplemented
        if func.namespace in _COLLECTIVES and func.overloadpacket.__name__ not in \
                _NOT_COLLECTIVES:
            self.calls.append(_describe(func, args))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_collectives(rank: int):
    """A ``CollectiveRecorder`` entered when ``OMNISCALE_RECORD_COLLECTIVES`` names a
    directory (its calls written there on exit, as ``collectives-rank-N.json``), else None."""
    import json
    import os
    from pathlib import Path

    out = os.environ.get(RECORD_ENV)
    if not out:
        yield None
        return
    recorder = CollectiveRecorder()
    try:
        with recorder:
            yield recorder
    finally:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"collectives-rank-{rank}.json").write_text(json.dumps(recorder.calls))


def _key(call: dict, me: int) -> tuple:
    """What every member of the group must issue alike; the group as offsets from its first
    rank, so that two ranks' own groups of one mesh dimension compare equal."""
    if "mark" in call:
        return ("mark", call["mark"])
    group = tuple(r - call["group"][0] for r in call["group"]) if call["group"] else ()
    return (call["op"], group, str(call["shapes"]), str(call["dtypes"]))


def disagreements(per_rank: list[list[dict]]) -> list[str]:
    """How the ranks' recorded sequences disagree ([] when they agree): the collectives (all
    but point-to-point) must be the same, in the same order, on every rank; each rank's sends
    to a peer must be as large as what the peer receives from it, in order (sizes: torch's
    own object sends give a scalar where the receiver's buffer is [1])."""
    problems = []
    streams = [[c for c in calls if c.get("op") not in _P2P] for calls in per_rank]
    for rank, stream in enumerate(streams[1:], start=1):
        for i, (a, b) in enumerate(zip(streams[0], stream)):
            if _key(a, 0) != _key(b, rank):
                problems.append(f"call {i}: rank 0 {_show(a)}, rank {rank} {_show(b)}")
                break
        else:
            if len(stream) != len(streams[0]):
                longer, extra = (0, streams[0]) if len(streams[0]) > len(stream) else \
                    (rank, stream)
                first = extra[min(len(stream), len(streams[0]))]
                problems.append(f"rank {longer} issues {abs(len(stream) - len(streams[0]))} "
                                f"more, from {_show(first)}")
    sent: dict = collections.defaultdict(list)
    received: dict = collections.defaultdict(list)
    for rank, calls in enumerate(per_rank):
        for c in calls:
            if c.get("op") == "send":
                sent[rank, c["peer"]].append([math.prod(s) for s in c["shapes"]])
            elif c.get("op") in _P2P:
                received[c["peer"], rank].append([math.prod(s) for s in c["shapes"]])
    for pair in sorted(set(sent) | set(received)):
        if sent[pair] != received[pair]:
            problems.append(f"rank {pair[0]} sends {len(sent[pair])} tensors to rank "
                            f"{pair[1]}, which receives {len(received[pair])} (or other sizes)")
    return problems


def _show(call: dict) -> str:
    if "mark" in call:
        return f"[{call['mark']}]"
    return (f"{call['op']} on ranks {call['group']} {call['shapes']} "
            f"({call['by'] or call['site']})")
