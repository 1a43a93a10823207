"""Writes through views made functional at trace time (autoshard.graph.viewwrites): the traced
graph computes what the model does with no in-place op on a view left, whatever the views."""

import pytest
import torch

import autoshard
from autoshard.graph.tracing import trace
from autoshard.graph.viewwrites import INVERTIBLE


class _Writes(torch.nn.Module):
    """Writes through a slice of a transposed view, through a select and through a strided view of
    a flat view, reads a view made
    before the writes after them, reads a view of a tensor written in place (not through a view)
    after the write, and writes through ``diagonal`` where ``diagonal=True``."""

    def __init__(self, diagonal: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.diagonal = diagonal

    def forward(self, x):
        y = self.proj(x)  # (4, 8)
        buf = torch.zeros(8, 4, dtype=y.dtype)
        early = buf[2]  # a view made before the writes, read after them
        buf.t()[:, 1:5] = y[:, :4] * 2  # through t, then slice
        buf[0] = y.sum(1)  # through select
        buf.view(-1).as_strided((2, 3), (4, 1), 9).copy_(y[:2, :3] - 1)  # through view, then as_strided
        if self.diagonal:
            buf.diagonal().fill_(1.0)
        z = y * 1.5
        head = z[:, :2]  # a view of z made before z is written in place, read after
        z.mul_(2)
        return (buf * 3).sum() + (early * early).sum() + y.pow(2).sum() + (head * z[:, 2:4]).sum()


def _run_traced(tg, model, x):
    """The traced step's loss and gradients, the graph run on real values."""
    params = [dict(model.named_parameters())[f] for f in tg.param_fqns]
    buffers = [dict(model.named_buffers())[f] for f in tg.buffer_fqns]
    out = tg.gm(*params, *buffers, x)
    return out[0], out[1:]


def test_writes_through_views_trace_to_the_models_values():
    torch.manual_seed(0)
    model, x = _Writes(), torch.randn(4, 8)
    tg = trace(model, (x,), lambda out: out)
    through_views = [n for n in tg.gm.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable
                     and isinstance(n.args[0], torch.fx.Node) and n.args[0].target in INVERTIBLE]
    assert not through_views, [n.name for n in through_views]
    targets = {n.target for n in tg.gm.graph.nodes}
    assert {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
            torch.ops.aten.as_strided_scatter.default} <= targets
    order = {n: k for k, n in enumerate(tg.gm.graph.nodes)}
    for m in tg.gm.graph.nodes:  # no view of a tensor written in place is read, unwritten, after the write
        if m.op == "call_function" and m.target._schema.is_mutable and m.args[0].op != "placeholder":
            for view in (u for u in m.args[0].users if u.target in INVERTIBLE and order[u] < order[m]):
                assert all(order[r] < order[m] for r in view.users), (m.name, view.name)
    loss, grads = _run_traced(tg, model, x)
    want = model(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for fqn, g in zip(tg.param_fqns, grads):
        torch.testing.assert_close(g, dict(model.named_parameters())[fqn].grad, msg=fqn)


def test_a_write_through_a_view_it_cannot_invert_is_refused():
    with pytest.raises(autoshard.TraceError, match=r"in-place write through the view .*diagonal.*cannot be planned"):
        trace(_Writes(diagonal=True), (torch.randn(4, 8),), lambda out: out)
