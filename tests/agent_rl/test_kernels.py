"""agent_rl.accel.kernels: the CPU kernels (built here: this machine has a compiler). blocked_linear
against hand-computed products and F.linear, its panel layout, and decode.PackedGroup;
rms_norm (and its training form, RMSNorm) and sample against hand-computed numbers and the
tensor ops they replace."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from agent_rl.accel import kernels
from agent_rl.policies import decode


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), "the kernel must build on this machine (gcc, ninja)"


def test_hand_computed_product_with_bias():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # [N=3, K=2]
    x = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # [M=2, K=2]
    bias = torch.tensor([0.5, -1.0, 2.0])
    y = kernels.blocked_linear(x, kernels.to_panels(w), bias, 3)
    # x W^T = [[1+2, 3+4, 5+6], [2, 6, 10]], plus the bias
    assert y.tolist() == [[3.5, 6.0, 13.0], [2.5, 5.0, 12.0]]
    assert kernels.blocked_linear(x, kernels.to_panels(w), None, 3).tolist() == [
        [3.0, 7.0, 11.0], [2.0, 6.0, 10.0]]


def test_panel_layout_and_in_place_reload():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # N = 40: one full panel, one partial
    panels = kernels.to_panels(w)
    assert panels.shape == (2, 3, 32)
    for n in (0, 5, 31, 32, 39):
        p, j = divmod(n, 32)
        assert panels[p, :, j].tolist() == w[n].tolist()
    assert panels[1, :, 8:].abs().sum() == 0  # rows past N are zero
    ptr = panels.data_ptr()
    again = kernels.to_panels(-w, out=panels)
    assert again.data_ptr() == ptr and panels[0, 2, 1] == -w[1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 32, 300])  # tiles of 12 rows
# (200, 96): 7 panels, several per thread: each tile prefetches a share of the next one
@pytest.mark.parametrize("shape", [(40, 7), (64, 64), (100, 96), (200, 96)])
def test_matches_f_linear(dtype, rows, shape):
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    w = torch.randn(shape, generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g)
    x = torch.randn(2, rows, shape[1], generator=g)  # [..., K]: leading dims kept
    y = kernels.blocked_linear(x, kernels.to_panels(w), bias, shape[0])
    assert y.shape == (2, rows, shape[0]) and y.dtype == torch.float32
    expect = torch.nn.functional.linear(x, w.float(), bias)
    torch.testing.assert_close(y, expect, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_pads_to_whole_panels(dtype):
    """The op itself returns whole panels (zero past N: zero weights, bias padded with zero)."""
    w, x, bias = torch.randn(40, 24).to(dtype), torch.randn(300, 24), torch.randn(40)
    y = torch.ops.agent_rl_kernels.blocked_linear(x, kernels.to_panels(w), bias)  # [300, 64]
    assert y.shape == (300, 64) and y[:, 40:].abs().sum() == 0  # the padded columns
    torch.testing.assert_close(y[:, :40], x @ w.float().t() + bias, atol=1e-4, rtol=1e-5)


def test_bf16_inputs_come_back_in_bf16():
    w = torch.randn(64, 32)
    x = torch.randn(4, 32).to(torch.bfloat16)
    y = kernels.blocked_linear(x, kernels.to_panels(w), None, 64)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ w.t(), atol=0.05, rtol=0.01)


def test_bad_inputs_are_named():
    panels = kernels.to_panels(torch.randn(32, 8))
    op = torch.ops.agent_rl_kernels.blocked_linear
    with pytest.raises(RuntimeError, match="blocked_linear: panels must be contiguous"):
        op(torch.randn(2, 9), panels, None)  # K mismatch
    with pytest.raises(RuntimeError, match="blocked_linear: x must be"):
        op(torch.randn(2, 8, dtype=torch.float64), panels, None)
    with pytest.raises(RuntimeError, match="blocked_linear: bias must be"):
        op(torch.randn(2, 8), panels, torch.randn(33))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 8), panels.double(), None)


def test_packed_group_is_its_parts_and_sees_their_pushes():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(24, n, bias=b) for n, b in ((40, True), (16, False), (33, True))]
    group = decode.PackedGroup(linears)
    assert group.panels.shape == (2 + 1 + 2, 24, 32)
    x = torch.randn(5, 24)
    outs = group(x)
    for out, linear, part in zip(outs, linears, group.parts, strict=True):
        expect = linear(x)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part(x), expect, atol=1e-5, rtol=1e-5)
    new = torch.randn(16, 24)
    group.parts[1].load(new)  # a push into one part: the group's product follows
    torch.testing.assert_close(group(x)[1], x @ new.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(group(x)[0], linears[0](x), atol=1e-5, rtol=1e-5)


def test_a_failed_build_warns_and_says_no(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.load.__wrapped__() is False
    message = next(str(w.message) for w in caught if "could not build broken.cpp" in str(w.message))
    assert "error:" in message  # the compiler's own diagnostic, not ninja's last line


def test_rms_norm_by_hand_and_against_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    # [3, 4]: mean of squares 12.5, 1 / sqrt(12.5) = 0.282843; times [1, 2]
    y = kernels.rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 0.0)
    torch.testing.assert_close(y, torch.tensor([[0.848528, 2.262742]]), atol=1e-6, rtol=0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 1, 576) * 3
    out = kernels.rms_norm(x, norm.weight.detach(), 1e-5)
    assert out.shape == (5, 1, 576)
    torch.testing.assert_close(out, norm(x).detach(), atol=2e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="weight must be contiguous float32 \\[H\\]"):
        kernels.rms_norm(x, torch.ones(575), 1e-5)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-d float32"):
        torch.ops.agent_rl_kernels.rms_norm(x.double().view(5, 576), torch.ones(576), 1e-5)


def test_training_rms_norm_by_hand_and_against_llama():
    """kernels.RMSNorm: forward as rms_norm, backward by hand on [3, 4] and against the
    tensor ops' autograd on Llama's module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    y = kernels.RMSNorm.apply(x, w, 0.0)
    torch.testing.assert_close(y.detach(), torch.tensor([[0.848528, 2.262742]]), atol=1e-6, rtol=0)
    y.sum().backward()
    # r = 1 / sqrt(12.5) = 0.282843, n = x r = [3 r, 4 r], dn = 1 * w = [1, 2],
    # mean(dn n) = (3 r + 8 r) / 2 = 5.5 r, n mean(dn n) = [16.5, 22] r^2 = [1.32, 1.76],
    # dx = r (dn - [1.32, 1.76]) = r [-0.32, 0.24] = [-0.090510, 0.067882]
    torch.testing.assert_close(x.grad, torch.tensor([[-0.090510, 0.067882]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.grad, torch.tensor([0.848528, 1.131371]), atol=1e-6, rtol=0)

    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    rows = (torch.randn(2, 67, 576) * 3).requires_grad_()
    grad = torch.randn(2, 67, 576)
    theirs = torch.autograd.grad(norm(rows), (rows, norm.weight), grad)
    out = kernels.RMSNorm.apply(rows, norm.weight, 1e-5)
    assert out.shape == (2, 67, 576)
    torch.testing.assert_close(out, norm(rows), atol=2e-6, rtol=1e-6)
    mine = torch.autograd.grad(out, (rows, norm.weight), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # bf16 out: the float32 result rounded once; a bf16 gradient is widened exactly, so the
    # gradients equal float32's for that gradient widened
    half = kernels.RMSNorm.apply(rows, norm.weight, 1e-5, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, out.bfloat16())
    grad16 = grad.bfloat16()
    for a, b in zip(torch.autograd.grad(half, (rows, norm.weight), grad16),
                    torch.autograd.grad(kernels.RMSNorm.apply(rows, norm.weight, 1e-5), (rows, norm.weight),
                                        grad16.float()), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="the result is float32 or bfloat16"):
        torch.ops.agent_rl_kernels.rms_norm_forward(rows.detach().view(-1, 576), norm.weight.detach(), 1e-5,
                                                    torch.float16)
    # a frozen weight gets no gradient
    frozen = kernels.RMSNorm.apply(rows, norm.weight.detach(), 1e-5)
    assert torch.autograd.grad(frozen, rows, grad)[0].shape == rows.shape
    with pytest.raises(RuntimeError, match="rstd float32 \\[M\\]"):
        torch.ops.agent_rl_kernels.rms_norm_backward(grad.view(-1, 576), rows.detach().view(-1, 576),
                                                     norm.weight.detach(), torch.ones(3))


def test_sample_by_hand():
    """Probabilities [1, 5, 14, 30] / 50: cumulative [1, 6, 20, 50] / 50; row b takes the
    first token whose cumulative probability exceeds its uniform."""
    p = torch.tensor([1.0, 5.0, 14.0, 30.0]) / 50
    logits = (p.log() + 3.0).repeat(5, 1)  # a shift changes nothing
    u = torch.tensor([0.0, 6 / 50 - 1e-4, 6 / 50 + 1e-4, 0.5, 0.9999])
    token, logp = kernels.sample(logits, u, 1.0)
    assert token.tolist() == [0, 1, 2, 3, 3]
    torch.testing.assert_close(logp, p.log()[token], atol=1e-6, rtol=0)
    # T = 0.5 squares the probabilities: [1, 25, 196, 900] / 1122
    token, logp = kernels.sample(logits[:2], torch.tensor([26 / 1122 - 1e-4, 26 / 1122 + 1e-4]), 0.5)
    assert token.tolist() == [1, 2]
    torch.testing.assert_close(logp, (torch.tensor([25.0, 196.0]) / 1122).log(), atol=1e-6, rtol=0)
    # a token at -inf is never taken, even by u = 0; a row longer than a block of 256 tokens
    # and not a multiple of 16, its only mass on the last token
    token, _ = kernels.sample(torch.tensor([[float("-inf"), 0.0, 0.0]]), torch.tensor([0.0]), 1.0)
    assert token.tolist() == [1]
    last = torch.full((1, 300), float("-inf"))
    last[0, 299] = 2.0
    token, logp = kernels.sample(last, torch.tensor([0.5]), 1.0)
    assert token.tolist() == [299] and logp.tolist() == [0.0]
    # a peaked row at T = 0.7 (its top token's log-prob rounds to 0, never above: a log-prob
    # over 0 is refused downstream; found in a Relay-v0 rollout)
    peaked = torch.zeros(1, 49152)
    peaked[0, 81] = 37.376365661621094
    token, logp = kernels.sample(peaked, torch.tensor([0.6364783644676208]), 0.7)
    assert token.tolist() == [81] and logp.item() <= 0.0 and logp.item() > -1e-6
    with pytest.raises(RuntimeError, match="uniforms must be contiguous float32 \\[B\\]"):
        kernels.sample(logits, torch.zeros(4), 1.0)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        kernels.sample(logits, u, 0.0)


def test_sample_matches_the_tensor_ops():
    """Against log-softmax, exp, cumsum and searchsorted (policy._sample_step's tensor path)
    on a 49,152-token vocabulary: the same tokens, log-probs within 1e-5."""
    from agent_rl.policies.logprobs import scaled_log_softmax

    torch.manual_seed(0)
    logits = torch.randn(64, 49152) * 4
    u = torch.rand(64)
    for T in (1.0, 0.7):
        token, logp = kernels.sample(logits, u, T)
        reference = scaled_log_softmax(logits, T)  # [B, V]
        cdf = reference.exp().cumsum(-1)
        expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert token.tolist() == expected.tolist()
        torch.testing.assert_close(logp, reference.gather(-1, token[:, None]).squeeze(-1), atol=1e-5, rtol=0)



def test_decode_attention_by_hand():
    """One row, one KV head, one query of 64 over 3 positions: scores q.k * scale = [0, 2, 0]
    with position 0 masked off, so softmax over positions 1, 2 = [e^2, 1] / (e^2 + 1)."""
    d = 64
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 1.0
    keys = torch.zeros(1, 1, 3, d)
    keys[0, 0, :, 0] = torch.tensor([5.0, 4.0, 0.0])  # q.k = 5, 4, 0; scale 0.5: 2.5, 2, 0
    values = torch.zeros(1, 1, 3, d)
    values[0, 0, :, 1] = torch.tensor([100.0, 1.0, 3.0])
    mask = torch.tensor([[False, True, True]])
    empty = keys[:, :, :0]
    out = kernels.decode_attention(q, keys, values, torch.tensor([0]), empty, empty, mask, 0.5)
    e = math.exp(2.0)
    assert out.shape == (1, 1, 1, d)
    assert out[0, 0, 0, 1].item() == pytest.approx((e * 1.0 + 3.0) / (e + 1), rel=1e-6)
    assert out[0, 0, 0, 0].item() == 0.0 and out[0, 0, 0, 2:].abs().sum() == 0
    # the same positions split: the first as a prompt held once (row 0 reads prompt 1), the
    # other two as the row's own
    prompts = torch.stack([torch.full_like(keys[0, :, :1], 9.0), keys[0, :, :1]])  # [2, 1, 1, d]
    prompt_values = torch.stack([torch.full_like(values[0, :, :1], 9.0), values[0, :, :1]])
    split = kernels.decode_attention(q, prompts, prompt_values, torch.tensor([1]), keys[:, :, 1:],
                                     values[:, :, 1:], mask, 0.5)
    torch.testing.assert_close(split, out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention_matches_sdpa(d):
    """Against F.scaled_dot_product_attention at a decode step's shapes (32 rows, 3 KV heads
    of 3 queries, slices of larger buffers, left padding masked, one row masked down to its
    last 3 positions): each row's own buffer, and prompts held once (4 prompts, 8 rows each)
    with the generated positions apart; within 1e-5."""
    torch.manual_seed(d)
    A, H, G, L, room = 32, 3, 3, 70, 24
    F = torch.nn.functional
    q = torch.randn(A, H, G, d)
    buffer_k, buffer_v = torch.randn(A, H, L + room, d), torch.randn(A, H, L + room, d)
    for s in (1, 9, 17):  # generated positions written so far (17 + 70 = 87: not a multiple of 16)
        mask = torch.ones(A, L + s, dtype=torch.bool)
        mask[:, :5] = False  # left padding
        mask[7, : L + s - 3] = False
        keys, values = buffer_k[:, :, : L + s], buffer_v[:, :, : L + s]
        expect = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=0.125)
        out = kernels.decode_attention(q, keys, values, torch.arange(A), keys[:, :, :0], values[:, :, :0],
                                       mask, 0.125)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=0)
        which = torch.arange(A) // 8
        prompt_k, prompt_v = torch.randn(4, H, L, d), torch.randn(4, H, L, d)
        gen_k, gen_v = buffer_k[:, :, :s], buffer_v[:, :, :s]
        expect = F.scaled_dot_product_attention(
            q, torch.cat([prompt_k[which], gen_k], 2), torch.cat([prompt_v[which], gen_v], 2),
            attn_mask=mask[:, None, None, :], scale=0.125)
        out = kernels.decode_attention(q, prompt_k, prompt_v, which, gen_k, gen_v, mask, 0.125)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=0)


def test_decode_attention_bad_inputs_are_named():
    op = torch.ops.agent_rl_kernels.decode_attention
    q, k = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 5, 64)
    e, rows, mask = k[:, :, :0], torch.arange(2), torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        op(torch.randn(2, 1, 3, 32), k[..., :32], k[..., :32], rows, e[..., :32], e[..., :32], mask, 1.0)
    with pytest.raises(RuntimeError, match="mask must be contiguous bool"):
        op(q, k, k, rows, e, e, mask[:, :4], 1.0)
    with pytest.raises(RuntimeError, match="rows1 out of range"):
        op(q, k, k, torch.tensor([0, 2]), e, e, mask, 1.0)
    with pytest.raises(RuntimeError, match="head_dim contiguous"):
        op(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, rows, e, e, mask, 1.0)
    assert not kernels.fits_decode(q, 32, 3) and not kernels.fits_decode(q, 64, 9)
    assert kernels.fits_decode(q, 64, 3) and not kernels.fits_decode(q.double(), 64, 3)


def test_rotary_write_by_hand_and_against_the_model():
    """d = 4 by hand: x = [1, 2, 3, 4], cos = [1, 1, 0, 0], sin = [0, 0, 1, 1] (signed:
    [0, 0, 1, 1] with the first half negated -> [-0, -0, 1, 1]): x cos + roll(x, 2) sin_s =
    [1, 2, 0, 0] + [3, 4, 1, 2] * [0, 0, 1, 1] = [1, 2, 1, 2]. Then SmolLM2's shapes against
    transformers' apply_rotary_pos_emb on strided rows of one product, written at a slot."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.tensor([[-0.0, -0.0, 1.0, 1.0]])
    keys, values = torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4)
    q = kernels.rotary_write(x, x * 10, x * 100, cos, sin, keys, values, 2)
    assert q.tolist() == [[1.0, 2.0, 1.0, 2.0]]
    assert keys[0, 0, 2].tolist() == [10.0, 20.0, 10.0, 20.0] and values[0, 0, 2].tolist() == [100.0, 200.0, 300.0, 400.0]
    assert keys[1].abs().sum() == 0 and keys[0, 0, :2].abs().sum() == 0  # nothing else written

    torch.manual_seed(0)
    A, nh, kvh, d = 5, 9, 3, 64
    product = torch.randn(A, (nh + 2 * kvh) * d)  # one packed q/k/v product: strided rows
    q, k, v = product[:, : nh * d], product[:, nh * d:(nh + kvh) * d], product[:, (nh + kvh) * d:]
    angle = torch.rand(A, d // 2) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # [A, d]
    keys, values = torch.zeros(8, kvh, 10, d), torch.zeros(8, kvh, 10, d)
    signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2:]], -1)
    out = kernels.rotary_write(q, k, v, cos, signed, keys, values, 7)
    expect_q, expect_k = apply_rotary_pos_emb(q.view(A, nh, 1, d), k.reshape(A, kvh, 1, d),
                                              cos[:, None], sin[:, None], unsqueeze_dim=1)
    torch.testing.assert_close(out.view(A, nh, 1, d), expect_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(keys[:A, :, 7], expect_k[:, :, 0], atol=1e-6, rtol=0)
    assert torch.equal(values[:A, :, 7], v.reshape(A, kvh, d))
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.rotary_write(q, k, v, cos, signed, keys, values, 10)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        kernels.rotary_write(q, k, v, cos[:, :10], signed, keys, values, 0)


def test_add_into_by_hand_and_to_the_bit():
    """dst += src in place: by hand (1.5 + bf16(2.25) = 3.75); then float32 and bf16 sources
    across the kernel's blocks of 4096 and a 7-wide tail, the same bits as add_; strided or
    other dtypes fall back to add_; the op itself names bad inputs."""
    dst = torch.tensor([1.5, -1.0])
    kernels.add_into(dst, torch.tensor([2.25, 0.5]).bfloat16())
    assert dst.tolist() == [3.75, -0.5]
    torch.manual_seed(0)
    for src_dtype in (torch.float32, torch.bfloat16):
        dst = torch.randn(3, 4096 + 7)
        src = torch.randn(3, 4096 + 7).to(src_dtype)
        expect = dst.clone().add_(src)
        kernels.add_into(dst, src)
        assert torch.equal(dst, expect)
    dst, src = torch.zeros(4, 6), torch.ones(6, 4).bfloat16().t()  # strided: add_
    kernels.add_into(dst, src)
    assert dst.eq(1.0).all()
    with pytest.raises(RuntimeError, match="add_into: dst float32"):
        torch.ops.agent_rl_kernels.add_into(torch.zeros(3).bfloat16(), torch.zeros(3))
    with pytest.raises(RuntimeError, match="of one shape"):
        torch.ops.agent_rl_kernels.add_into(torch.zeros(3), torch.zeros(4))


def test_silu_mul_by_hand_and_against_the_tensor_ops():
    """silu(x) = x / (1 + e^-x): silu(0) = 0, silu(2) * 3 = 6 / (1 + e^-2), silu(-2) * 1 =
    -2 / (1 + e^2); then halves of one product (strided rows, 1536 wide and a 7-wide tail)
    against F.silu(gate) * up."""
    gate, up = torch.tensor([[0.0, 2.0, -2.0]]), torch.tensor([[5.0, 3.0, 1.0]])
    out = kernels.silu_mul(gate, up)
    torch.testing.assert_close(out, torch.tensor([[0.0, 6 / (1 + math.exp(-2)), -2 / (1 + math.exp(2))]]),
                               atol=1e-6, rtol=0)
    torch.manual_seed(0)
    for width in (1536, 7):
        product = torch.randn(6, 2 * width) * 8
        gate, up = product[:, :width], product[:, width:]
        torch.testing.assert_close(kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up,
                                   atol=1e-5, rtol=1e-6)
    with pytest.raises(RuntimeError, match="gate and up must be float32 or bfloat16"):
        kernels.silu_mul(gate, up[:, :3])
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        kernels.silu_mul(gate, up.bfloat16())


def test_training_silu_mul_by_hand():
    """SiluMul's backward: with s = sigmoid(g), d(silu(g) u)/dg = u s (1 + g (1 - s)) and
    d/du = g s. At g = 0: s = 1/2, so dg = u / 2, du = 0; at g = 2, u = 3: s = 1 / (1 + e^-2),
    dg = 3 s (1 + 2 (1 - s)), du = 2 s; each times the incoming gradient (2 and -1)."""
    gate = torch.tensor([[0.0, 2.0]], requires_grad=True)
    up = torch.tensor([[5.0, 3.0]], requires_grad=True)
    kernels.SiluMul.apply(gate, up).backward(torch.tensor([[2.0, -1.0]]))
    s = 1 / (1 + math.exp(-2))
    torch.testing.assert_close(gate.grad, torch.tensor([[2 * 5 / 2, -3 * s * (1 + 2 * (1 - s))]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(up.grad, torch.tensor([[0.0, -2 * s]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_silu_mul_matches_the_tensor_ops(dtype):
    """Forward and backward against F.silu(gate) * up in float64 on the same inputs (halves of
    one product, 1536 and a 7-wide tail): float32 to rounding, bf16 within its rounding (once
    here, the tensor ops round twice) and no worse on average than the tensor ops in bf16."""
    torch.manual_seed(0)
    for width in (1536, 7):
        product = (torch.randn(40, 2 * width) * 4).to(dtype)
        grad = torch.randn(40, width).to(dtype)
        gate, up = product[:, :width].requires_grad_(), product[:, width:].requires_grad_()
        out = kernels.SiluMul.apply(gate, up)
        dg, du = torch.autograd.grad(out, (gate, up), grad)
        assert out.dtype == dg.dtype == du.dtype == dtype
        g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
        ref = torch.nn.functional.silu(g64) * u64
        rg, ru = torch.autograd.grad(ref, (g64, u64), grad.double())
        g16, u16 = gate.detach().requires_grad_(), up.detach().requires_grad_()
        theirs = torch.nn.functional.silu(g16) * u16
        tg, tu = torch.autograd.grad(theirs, (g16, u16), grad)
        for mine, exact, tensor_ops in ((out, ref, theirs), (dg, rg, tg), (du, ru, tu)):
            err = (mine.double() - exact).abs()
            if dtype == torch.float32:
                assert err.max() < 1e-4 * (1 + exact.abs().max())
            else:
                assert (err <= exact.abs() * 2 ** -8 + 1e-6).all()  # one bf16 rounding
                assert err.mean() <= (tensor_ops.double() - exact).abs().mean() * 1.05
    with pytest.raises(RuntimeError, match="grad must be contiguous, of gate's shape and dtype"):
        torch.ops.agent_rl_kernels.silu_mul_backward(grad[:, :3].contiguous(), gate.detach(), up.detach())


def test_rotary_by_hand():
    """D = 4, halves a = x[:2], b = x[2:], out = (a c1 - b s1, b c2 + a s2): x = (1, 2, 3, 4),
    cos = (0.5, 0.25, 0.5, 0.25), sin = (0.1, 0.2, 0.3, 0.4) give (0.5 - 0.3, 0.5 - 0.8,
    1.5 + 0.3, 1 + 0.8); the gradient's map (transpose) of the same x is (a c1 + b s2,
    b c2 - a s1) = (0.5 + 0.9, 0.5 + 1.6, 1.5 - 0.1, 1 - 0.4)."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    cos = torch.tensor([0.5, 0.25, 0.5, 0.25]).view(1, 1, 4)
    sin = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 4)
    op = torch.ops.agent_rl_kernels.rotary
    torch.testing.assert_close(op(x, cos, sin, torch.float32, False).flatten(), torch.tensor([0.2, -0.3, 1.8, 1.8]))
    torch.testing.assert_close(op(x, cos, sin, torch.float32, True).flatten(), torch.tensor([1.4, 2.1, 1.4, 0.6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40])  # halves of two vectors; of one and a tail of 4
def test_rotary_matches_llamas(dtype, d):
    """Forward and backward against transformers' apply_rotary_pos_emb on q as the attention
    makes it (a transposed view of the projection) with Llama's angles: float32 to rounding;
    a bf16 result is Llama's float32 result rounded once."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    R, H, T = 2, 3, 5
    proj = (torch.randn(R, T, H * d) * 2).to(dtype)
    freqs = torch.arange(T).float()[:, None] / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.cat([freqs, freqs], -1).expand(R, T, d)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    grad = torch.randn(R, H, T, d)
    mine_x = proj.clone().requires_grad_()
    q = mine_x.view(R, T, H, d).transpose(1, 2)
    out = kernels.Rotary.apply(q, cos, sin, torch.float32)
    (dx,) = torch.autograd.grad(out, mine_x, grad)
    their_x = proj.clone().requires_grad_()
    their_q = their_x.view(R, T, H, d).transpose(1, 2)
    ref = apply_rotary_pos_emb(their_q, their_q, cos, sin)[0]
    (want,) = torch.autograd.grad(ref, their_x, grad)
    assert out.is_contiguous() and dx.dtype == dtype
    torch.testing.assert_close(out, ref.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)
    half = kernels.Rotary.apply(q, cos, sin, torch.bfloat16)
    assert torch.equal(half, ref.float().bfloat16())


def test_rotary_bad_inputs_are_named():
    op = torch.ops.agent_rl_kernels.rotary
    x, cos = torch.zeros(1, 2, 3, 4), torch.zeros(1, 3, 4)
    with pytest.raises(RuntimeError, match="the head size 3 is odd"):
        op(x[..., :3], cos[..., :3], cos[..., :3], torch.float32, False)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        op(x, cos[:, :2], cos, torch.float32, False)
    with pytest.raises(RuntimeError, match="the last dimension contiguous"):
        op(x.transpose(2, 3), cos, cos, torch.float32, False)
    with pytest.raises(RuntimeError, match="the result is float32 or bfloat16"):
        op(x, cos, cos, torch.float16, False)


def test_chunk_attention_by_hand():
    """One head of 32, two queries: query 0 sees key 0, query 1 keys 0 and 1. q = 0, so every
    score is 0: out 0 = v0, out 1 = (v0 + v1) / 2, lse = 0 and log 2. Backward with dout rows
    g0 = e0, g1 = e0: row 1's dP = (g1 v0, g1 v1) = (1, 3), rowsum(g1 out1) = 2, dS = P (dP - 2)
    = (-0.5, 0.5); dq1 = scale (-0.5 k0 + 0.5 k1); row 0's dS = 0; dk = scale dS^T q = 0;
    dv0 = g0 + 0.5 g1, dv1 = 0.5 g1."""
    D, scale = 32, 0.5
    q = torch.zeros(1, 1, 2, D, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 2, D, dtype=torch.bfloat16)
    k[0, 0, 0, 0], k[0, 0, 1, 1] = 1.0, 2.0
    v = torch.zeros(1, 1, 2, D, dtype=torch.bfloat16)
    v[0, 0, 0, :2] = torch.tensor([1.0, 2.0])
    v[0, 0, 1, 0] = 3.0
    # two chunks: query 0 over key 0, query 1 over keys 0 and 1 (additive masks, all allowed)
    chunks = torch.tensor([[0, 0, 1, 0, 1], [0, 1, 1, 1, 2]])
    keys = torch.tensor([0, 0, 1])
    mask = torch.zeros(1 + 2)
    ext = torch.tensor([1, 2])  # each query's keys
    out, lse = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, mask, ext, scale, torch.float32)
    assert out.shape == (1, 2, 1, D) and out.dtype == torch.float32  # [R, T, H, D]
    assert out[0, 0, 0, :3].tolist() == [1.0, 2.0, 0.0]
    assert out[0, 1, 0, :3].tolist() == [2.0, 1.0, 0.0]
    assert lse[0, 0].tolist() == pytest.approx([0.0, math.log(2)], abs=1e-6)
    grad = torch.zeros(1, 2, 1, D)
    grad[0, :, 0, 0] = 1.0
    dq, dk, dv = torch.ops.agent_rl_kernels.chunk_attention_backward(grad, q, k, v, out, lse, chunks, keys,
                                                                      mask, ext, scale)
    assert dq[0, 0, 0].abs().max() == 0 and dk.abs().max() == 0
    assert dq[0, 1, 0, :3].tolist() == [-0.25, 0.5, 0.0]  # 0.5 (-0.5 [1, 0] + 0.5 [0, 2])
    assert dv[0, 0, 0, :2].tolist() == [1.5, 0.0] and dv[0, 1, 0, :2].tolist() == [0.5, 0.0]
    # a masked key takes no weight: query 1 with key 1 masked out sees only v0
    out, _ = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, torch.tensor([0.0, 0.0, -math.inf]),
                                                        ext, scale, torch.float32)
    assert out[0, 1, 0, :2].tolist() == [1.0, 2.0]
    # ... and so does a key past the query's extent, whatever its mask (the kernel skips it)
    out, _ = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, mask, torch.tensor([1, 1]), scale,
                                                        torch.float32)
    assert out[0, 1, 0, :2].tolist() == [1.0, 2.0]
    # bf16 out (these values are exact in bf16), and a bf16 gradient with it: the same numbers
    out16, lse16 = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, mask, ext, scale,
                                                              torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and out16[0, 1, 0, :3].tolist() == [2.0, 1.0, 0.0]
    assert torch.equal(lse16, lse)
    dq16, dk16, dv16 = torch.ops.agent_rl_kernels.chunk_attention_backward(grad.bfloat16(), q, k, v, out16, lse16,
                                                                            chunks, keys, mask, ext, scale)
    assert dq16[0, 1, 0, :3].tolist() == [-0.25, 0.5, 0.0] and dk16.abs().max() == 0
    assert dv16[0, 0, 0, :2].tolist() == [1.5, 0.0] and dv16[0, 1, 0, :2].tolist() == [0.5, 0.0]


@pytest.mark.parametrize("d", [32, 64])
def test_chunk_attention_matches_float32_sdpa(d):
    """Two rows of shared prompts and samples (render's layout), 6 query heads on 2 kv heads,
    the plan's chunks: values, lse and gradients as float32 SDPA on the same bf16 inputs,
    within bf16's rounding of the probabilities (and their gradients): ~2^-9 relative."""
    from agent_rl.accel.attention import plan_blocks
    from agent_rl.policies.render import packed_attention_mask

    gen = torch.Generator().manual_seed(0)
    # row 0: prompt 0 (5 tokens), samples 1 and 2 (40, 23), padding; row 1: prompt 0 (9), samples
    # 1, 2, 3 (20, 31, 7), a second prompt 4 (6) with sample 5 (3)
    seq = torch.tensor([[0] * 5 + [1] * 40 + [2] * 23 + [-1] * 4,
                        [0] * 9 + [1] * 20 + [2] * 31 + [3] * 7 + [4] * 2 + [5] * 3])  # [2, 72]
    prefix = torch.tensor([[-1] * 5 + [0] * 63 + [-1] * 4, [-1] * 9 + [0] * 58 + [-1] * 2 + [4] * 3])
    mask = packed_attention_mask(seq, torch.bool, prefix=prefix)  # [2, 1, 72, 72]
    mask[:, 0].diagonal(dim1=-2, dim2=-1).fill_(True)  # padding sees itself
    plan = plan_blocks(mask, split=16, call_pairs=100)
    chunks, keys, flat, ext = plan.tables
    q = torch.randn(2, 72, 6, d, generator=gen).bfloat16().transpose(1, 2)  # [R, H, T, D], strided
    k = torch.randn(2, 2, 72, d, generator=gen).bfloat16()
    v = torch.randn(2, 2, 72, d, generator=gen).bfloat16()
    scale = d ** -0.5
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    expect = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    out, lse = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, flat, ext, scale, torch.float32)
    scores = qf @ kf.repeat_interleave(3, 1).transpose(-1, -2) * scale  # [R, H, T, T]
    torch.testing.assert_close(lse, scores.masked_fill(~mask, -math.inf).logsumexp(-1).detach(),
                               rtol=0, atol=1e-5)

    def close(mine, theirs):
        assert float((mine - theirs).norm() / theirs.norm()) < 4e-3

    close(out.transpose(1, 2), expect.detach())
    grad = torch.randn(expect.shape, generator=gen).bfloat16().float()
    theirs = torch.autograd.grad(expect, (qf, kf, vf), grad)
    mine = torch.ops.agent_rl_kernels.chunk_attention_backward(grad.transpose(1, 2).contiguous(), q, k, v,
                                                               out, lse, chunks, keys, flat, ext, scale)
    for a, b in zip(mine, theirs, strict=True):
        close(a.transpose(1, 2), b)
    # bf16 out: float32's rounded once; a bf16 gradient and out give the gradients within the
    # same bound
    out16, _ = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, flat, ext, scale, torch.bfloat16)
    assert torch.equal(out16, out.bfloat16())
    mine16 = torch.ops.agent_rl_kernels.chunk_attention_backward(grad.transpose(1, 2).contiguous().bfloat16(), q,
                                                                 k, v, out16, lse, chunks, keys, flat, ext, scale)
    for a, b in zip(mine16, theirs, strict=True):
        close(a.transpose(1, 2), b)
    # the extents only skip what the mask rules out: every query at its chunk's full width
    # gives the same out, lse and dq to the bit; dk and dv to float32 rounding (chunks sharing
    # keys add into them in whichever order the threads take them, run to run alike)
    full = torch.cat([torch.full((int(c[2]),), int(c[4])) for c in chunks])
    assert bool((ext < full).any())  # there is something to skip
    wide, wide_lse = torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, flat, full, scale,
                                                                torch.float32)
    assert torch.equal(wide, out) and torch.equal(wide_lse, lse)
    wide_grads = torch.ops.agent_rl_kernels.chunk_attention_backward(grad.transpose(1, 2).contiguous(), q, k, v,
                                                                     out, lse, chunks, keys, flat, full, scale)
    assert torch.equal(wide_grads[0], mine[0])
    for a, b in zip(wide_grads[1:], mine[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunk_attention_bad_inputs_are_named():
    q = torch.zeros(1, 2, 4, 32, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 1, 4, 32, dtype=torch.bfloat16)
    chunks, keys, mask, ext = torch.tensor([[0, 0, 4, 0, 4]]), torch.arange(4), torch.zeros(16), torch.full((4,), 4)

    def op(q, k, v, chunks, keys, mask, scale, dtype, ext=ext):
        return torch.ops.agent_rl_kernels.chunk_attention(q, k, v, chunks, keys, mask, ext, scale, dtype)

    with pytest.raises(RuntimeError, match="all bfloat16"):
        op(q.float(), k, v, chunks, keys, mask, 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(q[..., :16], k[..., :16], v[..., :16], chunks, keys, mask, 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="chunk 0 is out of the batch's bounds"):
        op(q, k, v, torch.tensor([[0, 2, 4, 0, 4]]), keys, mask, 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="the mask holds 15 entries, the chunks need 16"):
        op(q, k, v, chunks, keys, mask[:15], 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="key position 4 is outside the row"):
        op(q, k, v, chunks, keys + 1, mask, 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="cover 3 queries of 4"):
        op(q, k, v, torch.tensor([[0, 0, 3, 0, 4]]), keys, mask[:12], 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="the result is float32 or bfloat16"):
        op(q, k, v, chunks, keys, mask, 1.0, torch.float16)
    with pytest.raises(RuntimeError, match="3 extents for 4 queries"):
        op(q, k, v, chunks, keys, mask, 1.0, torch.float32, ext=ext[:3])
    with pytest.raises(RuntimeError, match=r"query 2 of chunk 0 has extent 5, outside 1..4"):
        op(q, k, v, chunks, keys, mask, 1.0, torch.float32, ext=torch.tensor([4, 4, 5, 4]))
    with pytest.raises(RuntimeError, match=r"query 0 of chunk 0 has extent 0"):
        op(q, k, v, chunks, keys, mask, 1.0, torch.float32, ext=torch.tensor([0, 4, 4, 4]))
    with pytest.raises(RuntimeError, match="extents int64"):
        op(q, k, v, chunks, keys, mask, 1.0, torch.float32, ext=ext.int())
    out, lse = op(q, k, v, chunks, keys, mask, 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="dout and out float32 or bfloat16"):
        torch.ops.agent_rl_kernels.chunk_attention_backward(out.half(), q, k, v, out, lse, chunks, keys, mask, ext,
                                                            1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_by_hand(dtype):
    """A row of 18 zeros, a -inf and a 1 (20 logits: a vector of 16 and a tail of 4): the 1
    has probability e / (18 + e), each zero 1 / (18 + e), the -inf 0 (it adds nothing to the
    entropy, where 0 x -inf would be NaN); d log p_target / d x = onehot - p. At temperature 2
    the logits halve."""
    row = [0.0] * 18 + [-math.inf, 1.0]
    logits = torch.tensor([row, row], dtype=dtype, requires_grad=True)
    targets = torch.tensor([19, 0])
    for t in (1.0, 2.0):
        e = math.exp(1.0 / t)
        z = 18 + e
        p_one, p_zero = e / z, 1 / z
        logp, entropy = kernels.TokenLogprobs.apply(logits, targets, t)
        torch.testing.assert_close(logp, torch.tensor([math.log(p_one), math.log(p_zero)]), rtol=0, atol=2e-6)
        h = -(18 * p_zero * math.log(p_zero) + p_one * math.log(p_one))
        torch.testing.assert_close(entropy, torch.tensor([h, h]), rtol=0, atol=2e-6)
        assert logp.requires_grad and not entropy.requires_grad
        (grad,) = torch.autograd.grad(logp.sum(), logits)
        assert grad.dtype == dtype
        want = torch.tensor([[-p_zero] * 18 + [0.0, 1 - p_one], [1 - p_zero] + [-p_zero] * 17 + [0.0, -p_one]]) / t
        tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16's rounding of the gradient
        torch.testing.assert_close(grad.float(), want, rtol=0, atol=tol)


def test_the_trainers_token_logprobs_by_hand():
    """accel.trainer.token_logprobs (what the accelerator's handle scores trained tokens with):
    logits [0, ln 3] -> probabilities [1/4, 3/4]: target 1 has ln 0.75 = -0.2877, the entropy
    is -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623; at temperature 2 the logits halve, [0, ln
    sqrt 3] -> [0.3660, 0.6340]. logprobs.picked_logprobs_and_entropy's numbers to float rounding,
    the entropy carries no gradient, and a temperature of 0 is refused."""
    from agent_rl.accel.trainer import token_logprobs
    from agent_rl.policies.logprobs import picked_logprobs, picked_logprobs_and_entropy

    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]], requires_grad=True)
    targets = torch.tensor([1, 0])
    logp, entropy = token_logprobs(logits, targets)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(0.25)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, torch.tensor([h, h]), rtol=0, atol=1e-6)
    assert logp.requires_grad and not entropy.requires_grad
    assert "TokenLogprobs" in logp.grad_fn.name()  # our kernel, not the tensor ops
    p = 1 / (1 + math.sqrt(3.0))  # softmax([0, ln sqrt 3])[0]
    logp2, entropy2 = token_logprobs(logits, targets, temperature=2.0)
    h2 = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    torch.testing.assert_close(logp2, torch.tensor([math.log(1 - p), math.log(p)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy2, torch.tensor([h2, h2]), rtol=0, atol=1e-6)
    torch.testing.assert_close(logp2, picked_logprobs(logits, targets, 2.0), rtol=0, atol=1e-6)
    theirs = picked_logprobs_and_entropy(logits, targets, 2.0)
    torch.testing.assert_close(entropy2, theirs[1], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_the_tensor_ops(dtype, temperature):
    """Against log-softmax, its entropy and its gradient (float32 maths on the same logits),
    over rows of 1003 logits (vectors and a tail), with a weighted loss."""
    torch.manual_seed(0)
    logits = (torch.randn(7, 1003) * 4).to(dtype)
    targets = torch.randint(0, 1003, (7,))
    weights = torch.randn(7)
    mine = logits.clone().requires_grad_()
    logp, entropy = kernels.TokenLogprobs.apply(mine, targets, temperature)
    (grad,) = torch.autograd.grad((logp * weights).sum(), mine)
    ref = logits.float().requires_grad_()
    logq = F.log_softmax(ref / temperature, dim=-1)
    picked = logq.gather(-1, targets[:, None])[:, 0]
    (want,) = torch.autograd.grad((picked * weights).sum(), ref)
    torch.testing.assert_close(logp, picked.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(logq.exp() * logq).sum(-1).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.float(), want.to(dtype).float(), rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_token_logprobs_bad_inputs_are_named():
    logits, targets = torch.zeros(2, 5), torch.tensor([0, 4])
    op = torch.ops.agent_rl_kernels.token_logprobs
    with pytest.raises(RuntimeError, match="target 5 of row 1 is outside the vocabulary of 5"):
        op(logits, torch.tensor([0, 5]), 1.0)
    with pytest.raises(RuntimeError, match="target -1 of row 0"):
        op(logits, torch.tensor([-1, 0]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(logits.half(), targets, 1.0)
    with pytest.raises(RuntimeError, match="one per row of logits"):
        op(logits, targets[:1], 1.0)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        op(logits, targets, 0.0)
    with pytest.raises(RuntimeError, match="grad and lse must be contiguous float32"):
        torch.ops.agent_rl_kernels.token_logprobs_backward(torch.zeros(3), logits, targets, torch.zeros(2), 1.0)
    into = torch.ops.agent_rl_kernels.token_logprobs_backward_into
    for out in (torch.zeros(2, 4), torch.zeros(2, 5).bfloat16(), torch.zeros(5, 2).t()):
        with pytest.raises(RuntimeError, match="out must be a contiguous \\[N, V\\] tensor of the logits' dtype"):
            into(torch.zeros(2), logits, targets, torch.zeros(2), 1.0, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_gradient_goes_where_grad_into_says(dtype):
    """TokenLogprobs' grad_into: the gradient is written into the tensor it gives (the same
    values as into a new one, to the bit) and that tensor is the gradient; where it gives
    None or a tensor that does not fit (another dtype, shape or a transposed view), a new
    tensor with the same values."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 37) * 3).to(dtype)
    targets = torch.tensor([0, 36, 5])
    weights = torch.tensor([1.0, -2.0, 0.5])

    def grad_of(grad_into):
        mine = logits.clone().requires_grad_()
        logp, _ = kernels.TokenLogprobs.apply(mine, targets, 0.8, grad_into)
        (grad,) = torch.autograd.grad((logp * weights).sum(), mine)
        return grad

    plain = grad_of(None)
    kept = torch.full((5, 37), 7.0, dtype=dtype)
    asked = []
    placed = grad_of(lambda n: asked.append(n) or kept[1:1 + n])
    assert asked == [3] and placed.data_ptr() == kept[1].data_ptr()
    assert torch.equal(placed, plain) and torch.equal(kept[1:4], plain)
    assert torch.equal(kept[0], torch.full((37,), 7.0, dtype=dtype))  # nothing else written
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for misfit in (None, torch.zeros(3, 37, dtype=other), torch.zeros(2, 37, dtype=dtype),
                   torch.zeros(37, 3, dtype=dtype).t()):
        grad = grad_of(lambda n, misfit=misfit: misfit)
        assert torch.equal(grad, plain) and (misfit is None or grad.data_ptr() != misfit.data_ptr())
