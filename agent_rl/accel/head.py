"""The output head's gradient on the CPU: the ``[V, H]`` weight gradient of one optimizer step
computed once instead of once per micro-batch (``HeadGrads``, ``DeferredHead``), its tensors
kept from step to step (``HEAD_BUFFERS``), and a tied input embedding's gradient made sparse
(``sparse_tied_lookup``) so that it adds into the head's gradient without a ``[V, H]``
temporary. ``accel.step`` applies them; the values are the same sums (tested)."""

from __future__ import annotations

import contextlib
import weakref

import torch

from agent_rl.accel import kernels
from agent_rl.run.distributed import Backend, TorchBackend

# the output head's deferred weight gradient (``HeadGrads``) is computed once this many bytes
# of the head's output gradients are held
HEAD_GRAD_BYTES = 256 << 20
# ``HeadGrads``' buffers, kept from step to step per head weight: the bf16 cast, the
# gradients' rows and their product. Fresh tensors of this size (100+ MB) come from new pages
# every step, each page faulted in: a bf16 Relay-v0 step's gathering of the rows took ~0.14 s
# into fresh pages, 5 ms into kept ones, its product ~0.07 s more (ad hoc). Keyed by the
# weight's id, dropped when the weight is
HEAD_BUFFERS: dict[int, dict[str, torch.Tensor]] = {}


@contextlib.contextmanager
def sparse_tied_lookup(backend: Backend, model):
    """While inside, the input embedding's backward gives a sparse gradient when it is tied to
    the output embedding (SmolLM2) in a world of one.

    The lookup's dense gradient is a ``[V, H]`` tensor of zeros but for the looked-up rows
    (113 MB for SmolLM2), made afresh in every micro-batch and then added to the head's
    gradient into another fresh ``[V, H]`` tensor: two passes over fresh memory, each page a
    fault. Sparse, its rows are added into the head's dense gradient in place by autograd
    before the weight's gradient is accumulated: the same sum, still dense for the optimizer
    and the clip. Untied weights (a sparse ``.grad`` would reach the optimizer), several
    processes (DDP/ZeRO hooks) or a frozen embedding: nothing changes."""
    lookup, head = model.get_input_embeddings(), model.get_output_embeddings()
    applies = (backend.world_size == 1 and isinstance(backend, TorchBackend)
               and isinstance(lookup, torch.nn.Embedding) and lookup.max_norm is None
               and head is not None and head.weight is lookup.weight and lookup.weight.requires_grad)
    if not applies:
        yield
        return
    was = lookup.sparse
    lookup.sparse = True
    try:
        yield
    finally:
        lookup.sparse = was


class HeadGrads:
    """The output head's weight gradient of one optimizer step, computed once instead of once
    per micro-batch. Each micro-batch's backward (``DeferredHead``) keeps its ``[N, V]``
    gradient of the logits and the ``[N, H]`` hidden states it multiplied; ``flush()`` (before
    the optimizer step; also whenever ``HEAD_GRAD_BYTES`` are held) adds their product, one
    ``[V, N_total] x [N_total, H]`` product, into the weight's gradient. The same sum: under
    bf16 autocast the per-micro-batch ``[V, H]`` bf16 products were each cast to float32 and
    added into the gradient, ~160 MB written and read twice per micro-batch for SmolLM2's tied
    head; deferred, the product is rounded to bf16 once. Measured (ad hoc, SmolLM2's head, 9
    micro-batches of 125 trained tokens, bf16): 0.28 against 0.65 s a step. The weight's
    gradient is made dense (zeros) first, so that a tied embedding's sparse rows
    (``sparse_tied_lookup``) are added into it. ``of`` says where it applies: one process
    (``TorchBackend``, world of one: no hook waits for the gradient), a trainable bias-free
    ``nn.Linear`` head; elsewhere None and the head runs as before. Its tensors of the head's
    size live on from step to step (``HEAD_BUFFERS``), for their memory between steps
    (SmolLM2, bf16: ~230 MB): their pages are not faulted in again every step (whole bf16
    Relay-v0 steps 6.35 against 6.44 s, alternated)."""

    def __init__(self, weight: torch.nn.Parameter, dtype: torch.dtype):
        self.weight = weight
        self.dtype = dtype  # the products' dtype: bf16 under autocast
        # [V, H] once a step: the weights hold still until it ends
        self.cast = (weight.detach() if dtype == weight.dtype
                     else self.buffer("cast", weight.shape[0]).copy_(weight.detach()))
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # ([N, V], [N, H]) per backward
        self.held = 0  # bytes of the parts
        self.placed = 0  # the leading parts written in place into the kept "rows" buffer (``grad_rows``)
        self.placed_rows = 0  # and their rows
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

    @classmethod
    def of(cls, backend: Backend, model, dtype: torch.dtype) -> HeadGrads | None:
        head = model.get_output_embeddings()
        if (not isinstance(backend, TorchBackend) or backend.world_size != 1
                or not isinstance(head, torch.nn.Linear) or head.bias is not None
                or not head.weight.requires_grad or "forward" in vars(head)):
            return None
        return cls(head.weight, dtype)

    def add(self, grad: torch.Tensor, hidden: torch.Tensor) -> None:
        """One backward's ``[N, V]`` logits gradient and ``[N, H]`` hidden states."""
        there = self.grad_rows(grad.shape[0])
        if there is not None and grad.is_contiguous() and grad.dtype == there.dtype and grad.data_ptr() == there.data_ptr():
            self.placed, self.placed_rows = self.placed + 1, self.placed_rows + grad.shape[0]  # written in place
        self.parts.append((grad, hidden))
        self.held += grad.numel() * grad.element_size()
        if self.held >= HEAD_GRAD_BYTES:
            self.flush()

    def grad_rows(self, rows: int) -> torch.Tensor | None:
        """Where the next backward may write its ``[rows, V]`` logits gradient
        (``kernels.TokenLogprobs``' ``grad_into``): the kept "rows" buffer's rows after those
        held, while every part held lies there in order and it has room (it grows to a step's
        rows at ``flush``); else None, a new tensor. In place, ``flush`` multiplies them where
        they lie, where a new ``[N, V]`` tensor a micro-batch had its pages faulted in on the
        first write (profile, SmolLM2's bf16 Relay-v0 step: the kernel's backward took
        ~25 ms for 180 rows into new memory, ~1 ms into kept) and ``flush`` copied them all
        into the buffer. Whole bf16 steps alternated (8 each): 6.80 against 7.17 s, medians."""
        return self._next_rows(rows) if self.placed == len(self.parts) else None

    def _next_rows(self, rows: int) -> torch.Tensor | None:
        kept = self._kept("rows", self.placed_rows + rows, self.weight.shape[0])
        return None if kept is None else kept[self.placed_rows:self.placed_rows + rows]

    def flush(self) -> None:
        """Add the held parts' product into the weight's gradient."""
        if not self.parts:
            return
        grads, hidden = zip(*self.parts, strict=True)
        placed, start = self.placed, self.placed_rows
        self.parts, self.held, self.placed, self.placed_rows = [], 0, 0, 0
        n = sum(g.shape[0] for g in grads)
        rows = self._kept("rows", n, grads[0].shape[1])
        if rows is None:  # a new, larger tensor where n rows don't fit: nothing lies in it yet
            rows, placed, start = self.buffer("rows", n, grads[0].shape[1]), 0, 0
        with torch.no_grad():
            if placed < len(grads):  # the rest after those in place
                torch.cat(grads[placed:], out=rows[start:n])
            product = torch.mm(rows[:n].t(), torch.cat(hidden), out=self.buffer("product", self.weight.shape[0]))
            kernels.add_into(self.weight.grad, product)  # [V, H]

    def logits(self, rows: int) -> torch.Tensor:
        """Where a forward's ``[rows, V]`` logits go: one of two kept buffers that nothing else
        holds (a micro-batch's logits are done with once its backward ran, but a caller's
        variable may hold them until the next micro-batch's come back), else a new tensor.
        Written into fresh pages, the head's forward product ran at ~320 GFLOP/s in a bf16
        Relay-v0 step (profile, SmolLM2: [~125, 576] x [576, 49152]), into kept ones at ~760."""
        for name in ("logits", "logits 2"):
            buf = self.buffer(name, rows, self.weight.shape[0])
            if not _held_elsewhere(buf):
                return buf[:rows]
        return torch.empty(rows, self.weight.shape[0], dtype=self.dtype, device=self.weight.device)

    def buffer(self, name: str, rows: int, cols: int | None = None) -> torch.Tensor:
        """The kept buffer ``name`` (``HEAD_BUFFERS``) in ``self.dtype``: at least ``rows`` x
        ``cols`` (the head's width by default), grown when a step needs more rows."""
        cols = self.weight.shape[1] if cols is None else cols
        buf = self._kept(name, rows, cols)
        if buf is None:
            kept = HEAD_BUFFERS.get(id(self.weight))
            if kept is None:
                kept = HEAD_BUFFERS[id(self.weight)] = {}
                weakref.finalize(self.weight, HEAD_BUFFERS.pop, id(self.weight), None)
            buf = kept[name] = torch.empty(rows, cols, dtype=self.dtype, device=self.weight.device)
        return buf

    def _kept(self, name: str, rows: int, cols: int) -> torch.Tensor | None:
        """The kept buffer ``name`` where it holds ``rows`` x ``cols`` in ``self.dtype``, else None."""
        buf = HEAD_BUFFERS.get(id(self.weight), {}).get(name)
        fits = buf is not None and buf.dtype == self.dtype and buf.shape[0] >= rows and buf.shape[1] == cols
        return buf if fits else None


def _held_elsewhere(buf: torch.Tensor) -> bool:
    """Does any tensor but ``buf`` itself (a view of it, one autograd saved) use its memory?
    True where torch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    storage = buf.untyped_storage()  # a reference of its own while it lives
    return use_count(storage._cdata) > 2


class DeferredHead(torch.autograd.Function):
    """``hidden [N, H] @ weight^T`` in ``head.dtype`` (``HeadGrads``): the gradient of
    ``hidden`` at once, the weight's left to ``head`` (``apply(hidden, weight, head)``)."""

    @staticmethod
    def forward(ctx, hidden, weight, head):
        x = hidden.detach().to(head.dtype)  # [N, H]
        ctx.save_for_backward(x)
        ctx.head, ctx.hidden_dtype = head, hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.mm(x, head.cast.t(), out=head.logits(x.shape[0]))  # [N, V]

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        head = ctx.head
        grad = grad.to(head.dtype)  # [N, V]
        head.add(grad, x)
        return (grad @ head.cast).to(ctx.hidden_dtype), None, None


