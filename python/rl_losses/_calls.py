"""How the loss modules (rl_losses.losses) and verl's FusedLinearForPPO are called: nn.Module's call left out where
nothing hooks into it (DirectCallModule), and what every call of a loss module reads, bound once per implementation
outside the nn.Module (_Bound, _given).

Host time is what these save: a loss call at a small shape costs the host more than its kernels, and every attribute
read of an nn.Module goes through its ``__getattr__`` hook's machinery (~1 µs each with the caches cold after an op),
where a plain object's is one lookup."""
from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

import torch
from torch.jit import _trace as _jit_trace
from torch.nn.modules import module as _module

from rl_losses import _schema, functional
from rl_losses._inputs import _options

if typing.TYPE_CHECKING:
    from rl_losses.losses import Batch, LanguageModelLoss


def _require(batch: Batch, key: str, owner: str) -> Any:
    if batch.get(key) is None:
        raise ValueError(f"{owner}: the batch has no {key!r} (keys given: {sorted(batch)})")
    return batch[key]


# nn.Module's hooks of every module: dicts that registering a hook fills in place.
_GLOBAL_HOOKS = (_module._global_forward_pre_hooks, _module._global_forward_hooks, _module._global_backward_pre_hooks,
                 _module._global_backward_hooks)
_MODULE_CALL = torch.nn.Module.__call__


class DirectCallModule(torch.nn.Module):
    """An nn.Module whose call goes straight to its class's ``forward`` where nothing hooks into it.

    nn.Module's own call is two frames of ``*args`` and eight hook checks, each an attribute read of the module,
    before ``forward``: 5-10 µs of host time per call. This call reads one attribute, ``_module_call``: the module's
    own hook dicts (filled in place by registering a hook) and, once ``module.compile()`` or an assigned ``forward``
    has set them, a true value. With any of them, a hook of every module or while ``torch.jit.trace`` records module
    scopes (its ``_trace_module_map``, without which nn.Module's traced call is ``forward`` too), nn.Module's call runs
    as before. Each class defining ``forward`` gets this ``__call__`` with forward's own parameters (_direct_call: a call through
    ``*args`` costs more); torch.compile traces it as it traces nn.Module's."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = _direct_call(cls.forward)

    def __init__(self):
        super().__init__()
        self._module_call = (self._forward_pre_hooks, self._forward_hooks, self._backward_pre_hooks,
                             self._backward_hooks)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("_compiled_call_impl", "forward"):  # nn.Module's call runs these: every call takes it from now
            super().__setattr__("_module_call", (*self._module_call, True))


def _direct_call(forward: Callable) -> Callable:
    """DirectCallModule's ``__call__`` with the parameters of `forward` (defaults included): generated code."""
    signature = inspect.signature(forward)
    parameters = [p.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty)
                  for p in signature.parameters.values()]
    arguments = ", ".join({inspect.Parameter.VAR_POSITIONAL: f"*{p.name}", inspect.Parameter.VAR_KEYWORD: f"**{p.name}",
                           inspect.Parameter.KEYWORD_ONLY: f"{p.name}={p.name}"}.get(p.kind, p.name)
                          for p in parameters)
    module = parameters[0].name  # forward's own name for the module ("self")
    source = (f"def __call__{inspect.Signature(parameters)}:\n"
              f"    if any({module}._module_call) or any(_GLOBAL_HOOKS) or _jit_trace._trace_module_map is not None:\n"
              f"        return _MODULE_CALL({arguments})\n"
              f"    return type({module}).forward({arguments})\n")
    scope = {"_GLOBAL_HOOKS": _GLOBAL_HOOKS, "_MODULE_CALL": _MODULE_CALL, "_jit_trace": _jit_trace}
    exec(source, scope)
    call = scope["__call__"]
    call.__defaults__, call.__kwdefaults__ = forward.__defaults__, forward.__kwdefaults__
    call.__qualname__ = forward.__qualname__.replace(".forward", ".__call__")
    return call


class _Bound:
    """What every call of a loss module reads, found once per implementation (the extension's op or the reference)
    and kept out of the nn.Module, whose attribute reads cost its ``__getattr__`` hook's machinery: the config, the
    name and metric name, the weight; for the modules that bind their op's arguments (LanguageModelLoss._bind), the
    function, the options from the config with, for the extension's op, its own (``tp_group``; the callee must not
    change the dict), the batch's optional entries passed on where present ((option, batch key) pairs: None is the
    op's default, so left out) and the batch tensors the config needs ((option, batch key, what needs it))."""

    __slots__ = ("kernel", "config", "name", "new_logprobs_name", "weight", "function", "options", "batch_options",
                 "optional_keys", "required", "op", "wrapper", "keywords", "keys", "needed", "metric", "metric_at")

    def __init__(self, module: LanguageModelLoss, kernel: bool):
        self.kernel = kernel
        self.config = module.config
        self.name = module.name
        self.new_logprobs_name = f"{module.name}_new_logprobs"  # the one metric of the policy losses at "none"
        self.weight = module.config.weight
        self.function = module._function(kernel)
        self.options = {**module._fixed_options(), **module._options(kernel)}
        self.batch_options = module._batch_options()
        self.optional_keys = frozenset(key for _, key in self.batch_options)
        self.required = module._required()
        # The direct call of LanguageModelLoss.forward, around the functional wrapper (functional.DIRECT_FORMS): the
        # name of its op (whose C++ function it calls), the wrapper's name and keywords (_options of the batch's
        # entries), the batch keys of the op's tensors after the logits and the positions of those it needs, the
        # second metric's name and position in the op's results (None: the loss alone). None where the module's config
        # has more to do per call (_direct_inputs), the module has a tp_group or its class a _forward of its own (a
        # subclass's, which the direct call would skip).
        self.op = self.wrapper = self.keywords = self.keys = self.needed = self.metric = self.metric_at = None
        form = functional.DIRECT_FORMS.get(self.function) if module.tp_group is None and module._direct_ok else None
        inputs = module._direct_inputs() if form is not None else None
        if inputs is not None:
            self.op, self.wrapper, self.keywords = form
            self.keys, self.needed, field = inputs
            self.options = _options(self.wrapper, dict(self.options), self.keywords)  # converted as the wrapper would
            if field is not None:
                self.metric, self.metric_at = f"{module.name}_{field}", _schema.results(self.op).index(field)


def _given(bound: _Bound, batch: Batch) -> dict[str, Any]:
    """The options of a call: the bound ones, the batch's entries of ``bound.batch_options`` that are there and the
    batch tensors the config needs; in a new dict where the batch adds any (the caller passes it on with ``**``,
    which copies it)."""
    options = fixed = bound.options
    for name, key in bound.batch_options:
        value = batch.get(key)
        if value is not None:
            if options is fixed:
                options = dict(fixed)
            options[name] = value
    if bound.required:
        if options is fixed:
            options = dict(fixed)
        for name, key, why in bound.required:
            options[name] = _require(batch, key, f"{bound.name} ({why})")
    return options


_OPS = torch.ops.rl_losses


def _call_op(bound: _Bound, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A loss module's call as the op's C++ function with the bound options (``bound.op``): no frame of _forward, the
    wrapper, its _options, _direct or named result (~3-4 µs of host time per call on a CPU host). None where the batch
    lacks a tensor the op needs (the module's _forward then says which)."""
    get = batch.get
    tensors = tuple(map(get, bound.keys))
    for i in bound.needed:
        if tensors[i] is None:
            return None
    options = bound.options
    if bound.required or not bound.optional_keys.isdisjoint(batch):
        options = _given(bound, batch)
        if options is not bound.options:  # the batch's entries, converted as the wrapper converts them
            options = _options(bound.wrapper, options, bound.keywords)
    out = getattr(_OPS, bound.op)._op(logits, *tensors, **options)  # (the op the namespace holds now)
    loss = out[0]
    metrics = {bound.name: loss.data}
    if bound.metric is not None:
        metrics[bound.metric] = out[bound.metric_at]
    return (loss if bound.weight == 1.0 else loss * bound.weight), metrics
