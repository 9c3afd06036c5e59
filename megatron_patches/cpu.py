"""Megatron-Core 0.16.1 on a CPU-only torch build (gloo backend).

Megatron-Core assumes CUDA in six places that the training path reaches. Each function below
fixes one of them and is applied only when CUDA is absent (``apply_cpu_patches`` is a no-op on
a GPU machine). Before replacing anything it checks that the target still exists in the
installed Megatron-Core (``_guard``), so an upgrade that moves a target fails at start-up with
a message naming the patch, instead of silently training on a half-patched stack.

1. ``rng_tracker``: the model-parallel RNG tracker forks CUDA RNG states (every forward with
   dropout, and activation recompute). Replaced by a tracker over the CPU generator.
2. ``memory_buffer``: ``GlobalMemoryBuffer.get_tensor`` allocates on the current CUDA device.
3. ``causal_masks``: the causal-mask helpers hard-code ``device="cuda"`` (and
   ``fused_softmax`` imports them by name).
4. ``torch_proxy``: about a dozen call sites (DDP buffers, optimizer, grad clipping, pipeline
   schedules and send/recv, checkpoint save) use ``torch.cuda.current_device()``,
   ``synchronize()``, streams or ``device="cuda"``. Rather than copy those functions, the name
   ``torch`` inside Megatron-Core modules is bound to a proxy module that is real torch except
   that tensor factories map a CUDA device to CPU and ``torch.cuda`` is a CPU stand-in. Real
   ``torch`` seen by every other module is untouched (only ``Tensor.cuda`` becomes a no-op,
   which on a CPU build is otherwise always an error).
5. ``clip_grads``: ``clip_grad_by_total_norm_fp32`` asserts CUDA tensors.
6. ``type_strings``: the distributed and fp16/bf16 optimizers compare ``param.type()`` with
   strings such as ``'torch.cuda.FloatTensor'``; those two functions are recompiled from their
   own source with the CPU type names.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import inspect
import operator
import sys
import textwrap
import types

import torch

from megatron_patches._guard import PatchTargetMissing, require_attr, require_source

# Megatron-Core modules the training path uses; imported before patching so the proxy reaches
# them (modules imported later get it through the import hook).
_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
)


# ----------------------------------------------------------------------------- 1. RNG tracker
def patch_rng_tracker() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    base = require_attr(mrandom, "CudaRNGStatesTracker", "cpu.rng_tracker")
    for name in ("initialize_rng_tracker", "_get_cuda_rng_state", "_set_cuda_rng_state"):
        require_attr(mrandom, name, "cpu.rng_tracker")
    require_attr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", "cpu.rng_tracker")
    original_seed = require_attr(mrandom, "model_parallel_cuda_manual_seed", "cpu.rng_tracker")
    default_name = require_attr(mrandom, "_MODEL_PARALLEL_RNG_TRACKER_NAME", "cpu.rng_tracker")

    class CpuRNGStatesTracker(base):
        """The CUDA tracker's API over the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    def initialize_rng_tracker(
        use_te_rng_tracker=False,
        inference_rng_tracker=False,
        use_cudagraphable_rng=False,
        force_reset=False,
    ):
        if force_reset or not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    @functools.wraps(original_seed)
    def model_parallel_cuda_manual_seed(seed, *args, **kwargs):
        kwargs["force_reset_rng"] = True
        original_seed(seed, *args, **kwargs)
        torch.manual_seed(seed)

    mrandom.CpuRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


# ----------------------------------------------------------------------------- 2. memory buffer
def patch_memory_buffer() -> None:
    from megatron.core import utils

    cls = require_attr(utils, "GlobalMemoryBuffer", "cpu.memory_buffer")
    get_tensor_original = require_attr(cls, "get_tensor", "cpu.memory_buffer")
    require_source(get_tensor_original, "cuda", "cpu.memory_buffer")

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = functools.reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device="cpu")
            self.buffer[(name, dtype)] = buffer
        return buffer[0:numel].view(*tensor_shape)

    cls.get_tensor = get_tensor


# ----------------------------------------------------------------------------- 3. causal masks
def patch_causal_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        require_source(require_attr(tutils, name, "cpu.causal_masks"), "cuda", "cpu.causal_masks")

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def get_sliding_window_causal_mask(sq, skv, window_size):
        ones = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for module in (tutils, fused_softmax):
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = get_default_causal_mask
        if hasattr(module, "get_sliding_window_causal_mask"):
            module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


# ----------------------------------------------------------------------------- 4. torch proxy
_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace",
    "empty_strided", "randperm", "normal",
)  # fmt: skip


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class _NoopStream:
    """Stands in for CUDA streams and events: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cuda_stand_in() -> types.ModuleType:
    real = torch.cuda
    shim = types.ModuleType("megatron_patches.cpu.cuda")
    shim.current_device = lambda: "cpu"
    shim.synchronize = lambda *a, **k: None
    shim.empty_cache = lambda *a, **k: None
    shim.Stream = _NoopStream
    shim.Event = _NoopStream
    shim.stream = lambda *a, **k: _NoopStream()
    shim.default_stream = lambda *a, **k: _NoopStream()
    shim.current_stream = lambda *a, **k: _NoopStream()
    shim.memory_allocated = lambda *a, **k: 0
    shim.max_memory_allocated = lambda *a, **k: 0
    shim.manual_seed = lambda *a, **k: None
    shim.is_available = lambda: False
    shim.__getattr__ = lambda name: getattr(real, name)
    return shim


def _torch_proxy() -> types.ModuleType:
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    for name in _FACTORIES:
        setattr(proxy, name, _cpu_factory(getattr(torch, name)))
    proxy.cuda = _cuda_stand_in()
    proxy.__getattr__ = lambda name: getattr(torch, name)  # lazily loaded torch submodules
    return proxy


_PROXY: types.ModuleType | None = None


class _ProxyOnImport:
    """Import hook: Megatron-Core modules imported after apply() get the proxy too."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("megatron.core"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_proxy(module):
            exec_module(module)
            if getattr(module, "torch", None) is torch:
                module.torch = _PROXY

        spec.loader.exec_module = exec_with_proxy
        return spec


def patch_torch_proxy() -> int:
    """Bind ``torch`` in every loaded Megatron-Core module to the CPU proxy; return how many."""
    global _PROXY
    if _PROXY is None:
        _PROXY = _torch_proxy()
    count = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _PROXY
            count += 1
    if count == 0:
        raise PatchTargetMissing(
            "megatron_patches.cpu.torch_proxy: no loaded megatron.core module binds the name "
            "'torch'; the patch was written for 0.16.1. Review it against the new release."
        )
    if not any(isinstance(finder, _ProxyOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ProxyOnImport())
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # CPU build: .cuda() always fails
    return count


# ----------------------------------------------------------------------------- 5. clip_grads
def patch_clip_grads() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.utils import to_local_if_dtensor

    original = require_attr(clip_grads, "clip_grad_by_total_norm_fp32", "cpu.clip_grads")
    require_source(original, "cuda", "cpu.clip_grads")

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [
            to_local_if_dtensor(getattr(p, attr)).detach()
            for p in parameters
            if getattr(p, attr, None) is not None
        ]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    for module in (clip_grads, moptimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


# ----------------------------------------------------------------------------- 6. type strings
def _recompile(cls, name: str, replacements: list[tuple[str, str]], patch: str) -> None:
    """Recompile ``cls.name`` from its own source with textual replacements (same globals)."""
    module = sys.modules[cls.__module__]
    func = require_attr(cls, name, patch)
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in replacements:
        require_source(func, old, patch)
        source = source.replace(old, new)
    namespace: dict = {}
    filename = f"{inspect.getsourcefile(func)} [megatron_patches.{patch}]"
    exec(compile(source, filename, "exec"), module.__dict__, namespace)
    setattr(cls, name, namespace[name])


def patch_type_strings() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _recompile(
        DistributedOptimizer,
        "_build_model_and_main_param_groups",
        [("'torch.cuda.", "'torch.")],
        "cpu.type_strings",
    )
    _recompile(
        Float16OptimizerWithFloat16Params,
        "__init__",
        [
            ("'torch.cuda.", "'torch."),
            # zero-argument super() needs the class cell, which a recompiled function lacks
            ("super().__init__(", "super(Float16OptimizerWithFloat16Params, self).__init__("),
        ],
        "cpu.type_strings",
    )


CPU_PATCHES = {
    "rng_tracker": patch_rng_tracker,
    "memory_buffer": patch_memory_buffer,
    "causal_masks": patch_causal_masks,
    "clip_grads": patch_clip_grads,
    "type_strings": patch_type_strings,  # before the proxy: it reads pristine sources
    "torch_proxy": patch_torch_proxy,
}


def apply_cpu_patches() -> list[str]:
    """Apply every CPU patch (in order) and return their names."""
    for module in _MODULES:
        importlib.import_module(module)
    for patch in CPU_PATCHES.values():
        patch()
    return [f"cpu.{name}" for name in CPU_PATCHES]
