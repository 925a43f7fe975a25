"""`torch.library` custom ops for kdagen kernels, so that `torch.compile` traces a KDA forward or decode step
as one opaque node instead of breaking the graph.

``torch.ops.kdagen.forward(spec_json, q, k, v, g, beta, scale, A_log, dt_bias, initial_state,
output_final_state, cu_seqlens, policy_json) -> (o, final_state)``

``torch.ops.kdagen.decode(spec_json, q, k, v, g, beta, state_pool, state_indices, scale, A_log, dt_bias,
num_accepted_tokens, has_initial_state, update_state, cu_seqlens, out) -> o``

- ``spec_json`` is the spec's canonical JSON (`KernelSpec.canonical_json`, or `spec_json(spec)` here). The
  ops resolve it through `kdagen.get_kernel`, whose repeated lookup is an in-memory hit, so the string is
  the whole identity of the kernel and the graph holds it as a constant.
- ``policy_json`` is None (the kernel's own scheduling) or the JSON of `kdagen.policy.SchedulePolicy`'s
  fields (`policy_json(policy)` here).
- ``torch.ops.kdagen.forward_pool(spec_json, q, k, v, g, beta, scale, A_log, dt_bias, cu_seqlens,
  policy_json, state_pool, state_indices, has_initial_state, checkpoint_interval, start_positions,
  checkpoint_indices) -> o`` is the forward on a slot-indexed state pool, with optional prefix-cache
  checkpoints into its slots (the runtime's contract): it mutates ``state_pool`` (declared, so
  functionalization sees it), and its fake implementation gives ``o``. A mutating op takes no autograd
  formula: the runtime's own check refuses inputs that require grad when it is called with grad enabled.
- ``forward`` mutates nothing. ``final_state`` is an empty fp32 tensor when ``output_final_state`` is False
  (a custom op returns tensors, not None); `kda_forward` turns it back into None.
- ``decode`` is `KDAKernel.decode` (`kdagen.decode` has the contract): it writes ``state_pool`` in place and,
  when given, ``out``; the schema declares both mutated (``Tensor(a!) state_pool``, ``Tensor(a!)? out``), so
  `torch.compile`'s functionalization sees the writes and keeps them ordered with the graph's other uses of
  the pool (Inductor then calls the op on the caller's tensors, with no copy). A custom op may not return a
  tensor that aliases an input, so with ``out`` the op returns an empty tensor of q's dtype (as
  ``forward``'s absent state) and `kda_decode` returns ``out``; without it the op returns a new ``o``.
  ``update_state=False`` writes no slot, but the schema still declares the pool mutated: the schema is one
  for every call.
- The fake (meta) implementations read no tensor values. ``forward``'s gives ``o`` as ``[B, T, HV, V]`` in
  q's dtype and ``final_state`` as ``[N, HV, K, V]`` (``state_layout: kv``) or ``[N, HV, V, K]`` (``vk``)
  in fp32, N = B or ``len(cu_seqlens) - 1``. ``decode``'s runs `kdagen.decode.validate_decode_inputs` with
  ``require_cuda=False`` (the checks of shapes, dtypes, devices and strides; none of values or addresses),
  so a bad call fails while tracing with the runtime's `InputError`, and gives ``o`` as ``[B, T, HV, V]``
  in q's dtype.
- Training: ``torch.ops.kdagen.forward_train(spec_json, q, k, v, g, beta, scale, A_log, dt_bias,
  initial_state, output_final_state, cu_seqlens, policy_json, recompute) -> (o, final_state, states)`` is the
  forward for autograd: with ``recompute`` False it also returns the state entering every 64 tokens
  (`kdagen.backward.tile_states`), kept for the backward; with True, an empty tensor (the backward reruns
  the forward for them). ``torch.ops.kdagen.backward(spec_json, q, k, v, g, beta, scale, A_log, dt_bias,
  initial_state, cu_seqlens, policy_json, states, do, dht) -> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias,
  dh0)`` is `kdagen.backward.run_backward` (an absent gradient is an empty tensor). Both ``forward_train``
  and ``forward`` carry `register_autograd` formulas that call ``backward``, so `torch.compile` traces a
  training step with no graph break and the backward is one opaque node too. `kda_forward` routes a call
  whose inputs require grad (grad mode on) to ``forward_train``, or, where nothing traces (`_eager`), to
  `_EagerTrain`, an autograd function with the op's own forward, context and backward that skips the ops'
  dispatch (host time); the pool form and ``out`` have no backward
  and refuse such inputs with the runtime's `InputError`, as `kda_decode` does. ``decode`` mutates its
  arguments, and torch takes no autograd formula for such an op: called directly it runs (torch runs it
  with grad mode off, so its checks cannot tell), and a backward through its o raises torch's error for an
  op with no autograd formula.

`kda_forward(spec, q, k, v, g, beta, ...)` and `kda_decode(kernel, q, k, v, g, beta, *, state_pool,
state_indices, ...)` are the Python entry points with the runtime's signatures. Importing this module
imports torch and registers the ops; `import kdagen` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

import kdagen
from kdagen.decode import validate_decode_inputs
from kdagen.dtypes import DTYPES
from kdagen.errors import InputError
from kdagen.runtime import _check_no_grad, check_scale, check_state_form, refuse_grad, state_shape
from kdagen.spec import KernelSpec, resolve_spec

__all__ = [
    "kda_forward", "kda_decode", "spec_json", "policy_json", "OP_NAME", "POOL_OP_NAME", "DECODE_OP_NAME",
    "TRAIN_OP_NAME", "BACKWARD_OP_NAME",
]

OP_NAME = "kdagen::forward"
POOL_OP_NAME = "kdagen::forward_pool"
DECODE_OP_NAME = "kdagen::decode"
TRAIN_OP_NAME = "kdagen::forward_train"
BACKWARD_OP_NAME = "kdagen::backward"

# Parsed JSON per string: the ops see the same few strings on every call.
_spec_fields: dict[str, dict[str, Any]] = {}
_specs: dict[str, KernelSpec] = {}
_policies: dict[str, Any] = {}
_json_of: dict[Any, str] = {}


@torch.compiler.assume_constant_result
def spec_json(spec: KernelSpec | dict[str, Any] | str) -> str:
    """The canonical JSON of `spec` (a `KernelSpec`, a dict of fields, ``"file.yaml:name"``, or the JSON of
    its fields), the form the ops take. Resolved once per argument; `SpecError` for a bad spec.

    Under `torch.compile` the result is a constant of the graph (`assume_constant_result`): a traced call
    resolves its spec once, at trace time, and a later change of the object is not seen by that graph."""
    key: Any = json.dumps(spec, sort_keys=True) if isinstance(spec, dict) else spec
    found = _json_of.get(key)
    if found is None:
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            spec = _fields(spec)  # JSON of fields: validated and made canonical (defaults filled in)
        found = _json_of[key] = resolve_spec(spec)[1].canonical_json()
    return found


@torch.compiler.assume_constant_result
def policy_json(policy: Any) -> str | None:
    """`policy` (None, a `SchedulePolicy`, a dict of its fields, or its JSON) as the op's ``policy_json``."""
    if policy is None or isinstance(policy, str):
        return policy
    from kdagen.policy import SchedulePolicy

    fields = dataclasses.asdict(SchedulePolicy.coerce(policy))  # validates a dict
    return json.dumps(fields, sort_keys=True)


def _fields(spec_json_: str) -> dict[str, Any]:
    found = _spec_fields.get(spec_json_)
    if found is None:
        try:
            found = json.loads(spec_json_)
        except json.JSONDecodeError as e:
            raise InputError(
                f"spec_json: expected a spec's canonical JSON, got {spec_json_[:80]!r}: {e}") from None
        if not isinstance(found, dict):
            raise InputError(f"spec_json: expected a JSON object of spec fields, got {spec_json_[:80]!r}")
        _spec_fields[spec_json_] = found
    return found


def _spec(spec_json_: str) -> KernelSpec:
    # The checked spec of `spec_json_`, for a fake implementation (which loads no kernel).
    found = _specs.get(spec_json_)
    if found is None:
        found = _specs[spec_json_] = resolve_spec(_fields(spec_json_))[1]
    return found


def _kernel(spec_json_: str) -> Any:
    # Looked up on the package at call time: the kernel of `spec_json_` is built or loaded once per process.
    return kdagen.get_kernel(_fields(spec_json_))


def _policy(policy_json_: str | None) -> Any:
    if policy_json_ is None:
        return None
    found = _policies.get(policy_json_)
    if found is None:
        from kdagen.policy import SchedulePolicy

        found = _policies[policy_json_] = SchedulePolicy(**json.loads(policy_json_))
    return found


def _absent(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # An op's result that is not there (no final state asked for; decode's o written to `out`): a custom op
    # returns tensors, neither None nor an alias of an input.
    return like.new_empty((0,), dtype=dtype)


def _op_scale(scale: Any, head_dim_k: int) -> float | None:
    # The schema takes a float or None; another number goes through the runtime's check (which refuses a
    # bad one before any op is reached).
    return scale if scale is None or isinstance(scale, float) else check_scale(scale, head_dim_k)


@torch.library.custom_op(OP_NAME, mutates_args=())
def _forward(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    policy_json: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, ht = _kernel(spec_json)(
        q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, policy=_policy(policy_json))
    return o, (ht if ht is not None else _absent(q, torch.float32))


@_forward.register_fake
def _forward_fake(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    policy_json: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    fields = _fields(spec_json)
    kdim, vdim = fields["head_dim_k"], fields["head_dim_v"]
    bsz, seqlen, hv = v.shape[0], v.shape[1], v.shape[2]
    o = q.new_empty((bsz, seqlen, hv, vdim))
    if not output_final_state:
        return o, _absent(q, torch.float32)
    nseq = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (nseq, hv, kdim, vdim) if fields["state_layout"] == "kv" else (nseq, hv, vdim, kdim)
    return o, q.new_empty(shape, dtype=getattr(torch, DTYPES[fields.get("state_dtype", "fp32")].torch))


_GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _train_forward(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # `kdagen::forward_train` (registered below), also called directly by the eager path (`_EagerTrain`).
    kernel = _kernel(spec_json)
    if recompute:
        o, ht = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                       initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, policy=_policy(policy_json))
        return o, (ht if ht is not None else _absent(q, torch.float32)), _absent(q, torch.float32)
    from kdagen.backward import tile_states

    o, ht, states = tile_states(kernel, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                initial_state=initial_state, cu_seqlens=cu_seqlens,
                                policy=_policy(policy_json))
    return o, (ht if output_final_state else _absent(q, torch.float32)), states


_forward_train = torch.library.custom_op(TRAIN_OP_NAME, mutates_args=())(_train_forward)


@_forward_train.register_fake
def _forward_train_fake(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o, ht = _forward_fake(spec_json, q, k, v, g, beta, scale, A_log, dt_bias, initial_state,
                          output_final_state, cu_seqlens, policy_json)
    if recompute:
        return o, ht, _absent(q, torch.float32)
    spec = _spec(spec_json)
    from kdagen.plan import bwd_state_tiles
    from kdagen.workspace import tile_slots

    nseq = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    slots = tile_slots(v.shape[0] * v.shape[1], nseq, bwd_state_tiles(spec))
    mma_dtype = getattr(torch, DTYPES[spec.dtype].torch)  # tile states in the MMA type (`tile_states`)
    return o, ht, q.new_empty(state_shape(spec, slots, v.shape[2]), dtype=mma_dtype)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    # inputs: the op's arguments in schema order; both forward ops share the first 13 (`kdagen::forward`'s),
    # and `kdagen::forward_train` returns the tile states third (empty when the backward recomputes them).
    (spec_json_, q, k, v, g, beta, scale, A_log, dt_bias, initial_state, _out_final, cu_seqlens,
     policy_json_) = inputs[:13]
    states = output[2] if len(output) > 2 and output[2].numel() else None
    ctx.spec_json, ctx.scale, ctx.policy_json = spec_json_, scale, policy_json_
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, states)


def _backward(ctx: Any, do: Any, dht: Any, *_states_grad: Any) -> tuple[Any, ...]:
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, states = ctx.saved_tensors
    if dht is not None and dht.numel() == 0:
        dht = None
    args = (ctx.spec_json, q, k, v, g, beta, ctx.scale, A_log, dt_bias, initial_state, cu_seqlens,
            ctx.policy_json, states, do, dht)
    grads = _run_backward(*args) if _eager(args) else torch.ops.kdagen.backward(*args)
    dq, dk, dv, dg, dbeta, d_alog, d_bias, dh0 = grads
    needs = ctx.needs_input_grad
    out = [None, dq, dk, dv, dg, dbeta, None,
           d_alog if A_log is not None else None, d_bias if dt_bias is not None else None,
           dh0.to(initial_state.dtype) if initial_state is not None else None, None, None, None]
    out = [x if x is not None and needs[i] else None for i, x in enumerate(out)]
    return tuple(out + [None] * (len(needs) - len(out)))


_forward.register_autograd(_backward, setup_context=_setup_context)
_forward_train.register_autograd(_backward, setup_context=_setup_context)


def _eager(args: tuple[Any, ...]) -> bool:
    """True where a training call may skip the ops' dispatch: plain tensors (no fake, functional or other
    subclass), not compiling, no dispatch or function mode and no `torch.func` transform active. There the
    ops' Python autograd wrapper and checks add host time and nothing else (~0.3 ms of a forward, ~0.5 ms of
    a backward on an H200 host), and the call runs the same functions directly (`_EagerTrain`); anything
    that traces takes the ops, so graphs still hold one node each."""
    if torch.compiler.is_compiling():
        return False
    if (torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()
            or torch._C._are_functorch_transforms_active()):
        return False
    return all(type(t) is torch.Tensor for t in args if isinstance(t, torch.Tensor))


class _EagerTrain(torch.autograd.Function):
    """`kdagen::forward_train` with its autograd formula, for eager calls (`_eager`): the same forward
    (`_train_forward`), context and backward (`_backward`) as the op's."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = _train_forward(*inputs)
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(out[2])
        # Gradients of outputs the loss does not reach stay None: the backward takes a missing dO and dht.
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, do: Any, dht: Any, *_states_grad: Any) -> tuple[Any, ...]:
        return _backward(ctx, do, dht)


def _run_backward(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    states: torch.Tensor | None,
    do: torch.Tensor | None,
    dht: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    # `kdagen::backward` (registered below), also called directly on the eager path.
    from kdagen.backward import run_backward

    r = run_backward(_kernel(spec_json), q, k, v, g, beta, do, dht=dht, scale=scale, A_log=A_log,
                     dt_bias=dt_bias, initial_state=initial_state, cu_seqlens=cu_seqlens, states=states,
                     policy=_policy(policy_json))
    # (An absent gradient is an empty tensor of its own: returns may not alias one another.)
    return (r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dA_log if r.dA_log is not None else _absent(q, torch.float32),
            r.ddt_bias if r.ddt_bias is not None else _absent(q, torch.float32), r.dh0)


_backward_op = torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())(_run_backward)


@_backward_op.register_fake
def _backward_op_fake(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    states: torch.Tensor | None,
    do: torch.Tensor | None,
    dht: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    spec = _spec(spec_json)
    nseq = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta),
            torch.empty_like(A_log) if A_log is not None else _absent(q, torch.float32),
            torch.empty_like(dt_bias) if dt_bias is not None else _absent(q, torch.float32),
            q.new_empty(state_shape(spec, nseq, v.shape[2]), dtype=torch.float32))


@torch.library.custom_op(POOL_OP_NAME, mutates_args=("state_pool",))
def _forward_pool(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    checkpoint_interval: int | None = None,
    start_positions: torch.Tensor | None = None,
    checkpoint_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    kernel = kdagen.get_kernel(_fields(spec_json))
    ckpt = {} if checkpoint_interval is None and start_positions is None and checkpoint_indices is None else {
        "checkpoint_interval": checkpoint_interval, "start_positions": start_positions,
        "checkpoint_indices": checkpoint_indices}
    o, _ = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                  policy=_policy(policy_json), state_pool=state_pool, state_indices=state_indices,
                  has_initial_state=has_initial_state, **ckpt)
    return o


@_forward_pool.register_fake
def _forward_pool_fake(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    policy_json: str | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    checkpoint_interval: int | None = None,
    start_positions: torch.Tensor | None = None,
    checkpoint_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    vdim = _fields(spec_json)["head_dim_v"]
    return q.new_empty((v.shape[0], v.shape[1], v.shape[2], vdim))


def kda_forward(
    spec: KernelSpec | dict[str, Any] | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    policy: Any = None,
    state_pool: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    checkpoint_interval: int | None = None,
    start_positions: torch.Tensor | None = None,
    checkpoint_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, final_state or None)`` of the KDA forward of `spec` through the ``kdagen::forward`` op; with
    ``state_pool`` through ``kdagen::forward_pool``: ``(o, None)``, the final states (and the prefix-cache
    checkpoints) written into the pool in place. With grad enabled and an input that requires grad, through
    ``kdagen::forward_train``, which records the autograd node (``recompute``: `KDAKernel.__call__`); the
    pool form and ``out`` have no backward.

    The arguments are the runtime's (`kdagen.runtime.KDAKernel.__call__`); `spec` is a `KernelSpec`, a dict
    of fields, ``"file.yaml:name"`` or canonical JSON. Under `torch.compile` pass canonical JSON (or an
    object whose `spec_json` was taken outside the compiled region) so that nothing is resolved while
    tracing."""
    grads = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
             "initial_state": initial_state}
    training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in grads.values())
    if training and (state_pool is not None or out is not None):
        refuse_grad(grads)
    _check_no_grad({"state_pool": state_pool, "out": out})
    check_state_form(state_pool, state_indices, has_initial_state, initial_state, output_final_state,
                     checkpoint_interval, start_positions, checkpoint_indices)
    scale = _op_scale(scale, q.shape[-1])
    if out is not None:  # no op takes out: the kernel writes it (inference only)
        kern = kdagen.get_kernel(spec_json(spec))
        return kern(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, policy=policy,
                    state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
                    checkpoint_interval=checkpoint_interval, start_positions=start_positions,
                    checkpoint_indices=checkpoint_indices, out=out)
    if training:
        args = (spec_json(spec), q, k, v, g, beta, scale, A_log, dt_bias, initial_state, output_final_state,
                cu_seqlens, policy_json(policy), recompute)
        o, ht, _ = _EagerTrain.apply(*args) if _eager(args) else torch.ops.kdagen.forward_train(*args)
        return o, (ht if output_final_state else None)
    if state_pool is not None:
        o = torch.ops.kdagen.forward_pool(spec_json(spec), q, k, v, g, beta, scale, A_log, dt_bias,
                                          cu_seqlens, policy_json(policy), state_pool, state_indices,
                                          has_initial_state, checkpoint_interval, start_positions,
                                          checkpoint_indices)
        return o, None
    o, ht = torch.ops.kdagen.forward(spec_json(spec), q, k, v, g, beta, scale, A_log, dt_bias, initial_state,
                                     output_final_state, cu_seqlens, policy_json(policy))
    return o, (ht if output_final_state else None)


# ---- decode ----------------------------------------------------------------------------------------------


# Every argument is required: torch's in-place bookkeeping of a mutated argument indexes the call's
# positional arguments, from which a trailing default (out=None) would be dropped.
@torch.library.custom_op(DECODE_OP_NAME, mutates_args=("state_pool", "out"))
def _decode(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    update_state: bool,
    cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    o = _kernel(spec_json).decode(
        q, k, v, g, beta, state_pool=state_pool, state_indices=state_indices, scale=scale, A_log=A_log,
        dt_bias=dt_bias, num_accepted_tokens=num_accepted_tokens, has_initial_state=has_initial_state,
        update_state=update_state, cu_seqlens=cu_seqlens, out=out)
    return o if out is None else _absent(q, q.dtype)


@_decode.register_fake
def _decode_fake(
    spec_json: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    update_state: bool,
    cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    # The kernel's checks of everything but values and addresses, so that a bad call fails while tracing with
    # the error an eager call gives; q's device is not checked (CPU and meta tensors trace too).
    spec = _spec(spec_json)
    check_scale(scale, spec.head_dim_k)
    bsz, seqlen, _, hv, _ = validate_decode_inputs(
        spec, q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens,
        has_initial_state, cu_seqlens, out, require_cuda=False)
    if out is not None:
        return _absent(q, q.dtype)
    return q.new_empty((bsz, seqlen, hv, spec.head_dim_v))


def kda_decode(
    kernel: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    update_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`KDAKernel.decode` through the ``kdagen::decode`` op: ``state_pool`` is updated in place and o
    ``[N, S, HV, V]`` (``out`` when given) is returned.

    `kernel` is a `KDAKernel` (the op finds it again by its spec), a `KernelSpec`, a dict of fields,
    ``"file.yaml:name"`` or canonical JSON; the other arguments are `KDAKernel.decode`'s (the contract:
    `kdagen.decode`). Under `torch.compile` pass canonical JSON or an object whose spec was resolved outside
    the compiled region (a `KDAKernel` or `KernelSpec`) so that nothing is resolved while tracing."""
    _check_no_grad({"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                    "state_pool": state_pool})
    o = torch.ops.kdagen.decode(
        spec_json(getattr(kernel, "spec", kernel)), q, k, v, g, beta, state_pool, state_indices,
        _op_scale(scale, q.shape[-1]), A_log, dt_bias, num_accepted_tokens, has_initial_state, update_state,
        cu_seqlens, out)
    return o if out is None else out
