"""Memory that follows the tokens (docs/benchmarks.md, "Where a step's memory goes"): what the packed attention keeps
for its backward is sized by the segments' tokens and keys, never by heads x queries x keys; TRL's fused head, under
the seam's `compact_lm_head`, never builds a (positions, vocab) tile wider than `HEAD_TILE_ELEMENTS`, with outputs
and gradients equal to a single call. Counts of bytes and rows, never timings."""

import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from torch.utils._python_dispatch import TorchDispatchMode
from trl.trainer.utils import add_fused_lm_head

from trl_pruned_dpo import seam
from trl_pruned_dpo.seam import kernels


def _saved_bytes(fn, shapes: list | None = None) -> int:
    """Bytes of the storages autograd keeps for the backward of `fn()`, each storage counted once; `shapes` collects
    the shape of every saved tensor."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if shapes is not None:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_packed_attention_keeps_tokens_not_scores_for_backward():
    """One long branch segment after a shared part (lower-right causal, 192 queries over 448 keys), one plain segment
    and a one-token one; 8 query heads over 2 key heads. Kept for backward, per segment: its keys' worth of query and
    output rows (a branch's queries run as the last rows of a plain causal block over its keys), k and v (at most
    repeated to the query heads), a logsumexp per row and head; no lq x lk mask and no score. The math path that 3D
    inputs took kept 8 heads x lq x lk scores and probabilities per segment: over 4x this bound."""
    heads, kv_heads, dim = 8, 2, 16
    q_lens, k_lens = [192, 64, 1], [448, 64, 9]
    host_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    host_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    packing = kernels.Packing(torch.tensor(host_q, dtype=torch.int32), torch.tensor(host_k, dtype=torch.int32),
                                None, max(q_lens), max(k_lens), host_q, host_k)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(host_q[-1], heads, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(host_k[-1], kv_heads, dim, generator=g, requires_grad=True) for _ in range(2))

    shapes = []
    saved = _saved_bytes(lambda: kernels._per_segment(q, k, v, packing, dim ** -0.5), shapes)
    assert not [s for s in shapes if s[-2:] == (192, 448)], shapes  # no mask of the branch's queries x keys

    keys = host_k[-1]  # the query rows run: each segment's keys
    bound = 4 * (2 * keys * heads * dim + 2 * keys * heads * dim + keys * heads)
    math_path = 4 * 2 * heads * sum(lq * lk for lq, lk in zip(q_lens, k_lens))
    assert math_path > 4 * bound  # the shapes tell the two apart
    assert saved <= bound, (saved, bound)


class _HeadTiles(TorchDispatchMode):
    """The rows of every matrix product whose output is `vocab` wide (the head's tiles, forward and backward)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


def _head_outputs(counter=None):
    """Log-probs, entropy and the gradients of a tiny Llama's fused head over 40 labelled positions."""
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(1, 64, (1, 48))
    labels = torch.full_like(input_ids, -100)
    labels[0, 8:] = torch.randint(0, 64, (40,))
    with seam.compact_lm_head(), (counter or contextlib.nullcontext()):
        out = model(input_ids=input_ids, shift_labels=labels, use_cache=False, fused_lm_head=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
    return [out.log_probs.detach(), out.entropy.detach(), *(p.grad for p in model.parameters())]


def test_head_tiles_are_bounded(monkeypatch):
    """`compact_lm_head` calls TRL's head on slices of at most HEAD_TILE_ELEMENTS / vocab positions (forward and
    backward tiles), and the slices give the single call's log-probs, entropy and gradients (round-off only). Also pins
    that TRL's fused head still calls `trl.trainer.utils._ChunkedLogProbFunction` (else no tile would be sliced)."""
    whole = _head_outputs()
    monkeypatch.setattr(seam, "HEAD_TILE_ELEMENTS", 64 * 16)  # 16 positions per slice of a 64-token vocabulary
    counter = _HeadTiles(64)
    sliced = _head_outputs(counter)
    assert counter.rows and max(counter.rows) == 16  # 40 positions: 16 + 16 + 8, forward and backward
    assert sum(counter.rows) == 2 * 40
    for a, b in zip(sliced, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sliced_head_trains_exactly_as_stock(monkeypatch, tokenizer, tmp_path):
    """The exact preset with the head sliced to 3 positions per call (policy and reference forwards, checkpointing
    on): loss and every gradient as stock's (test_packed.assert_exact). Stock calls TRL's head once per forward."""
    import trl.trainer.utils as trl_utils
    from test_packed import assert_exact, family, pair_of_trainers

    class Counted:
        def __init__(self, function):
            self.function, self.rows = function, []

        def apply(self, hidden, *rest):
            self.rows.append(hidden.shape[0])
            return self.function.apply(hidden, *rest)

    counted = Counted(trl_utils._ChunkedLogProbFunction)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", counted)
    monkeypatch.setattr(seam, "HEAD_TILE_ELEMENTS", 3 * len(tokenizer))
    stock, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, padding_free=True, share_prompt=True,
                                     prune_common_prefix=True)
    counted.rows.clear()  # (building the trainers checks the compact head once)
    assert_exact(stock, pruned, checkpointing=True)
    whole = [n for n in counted.rows if n > 3]
    assert len(whole) == 2  # stock: its policy and its reference forward
    assert len(counted.rows) - len(whole) > 2 * 4  # the plugin's: both forwards, each in several slices


def test_breakdown_replays_allocations_to_their_peak():
    """benchmarks/memory_breakdown.py's replay: the peak is the maximum of the live bytes in time order, and what was
    live then is attributed (a freed allocation is not; one never freed in the step is)."""
    from benchmarks.memory_breakdown import peak_breakdown

    head, layer = ("backward", "head", "aten::mul"), ("backward", "mlp", "aten::mm")
    kept = ("fwd", "model", "aten::add")
    allocs = [[0, None, 10, kept], [1, 3, 100, head], [4, 6, 60, layer], [5, 7, 30, layer]]
    peak, live, regions = peak_breakdown(allocs)
    assert peak == 110 and live == {kept: 10, head: 100}
    assert regions["backward"] == 110 and regions["fwd"] == 10
