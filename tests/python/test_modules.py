"""attnkit.nn and attnkit.models from Python: errors, the torch.nn.Module
contract (state_dict, deepcopy, pickle, dtype conversion, optimizers, frozen
parameters), the mechanism classes, DocumentMemory, MultiheadAttention's
torch conventions, and the closed forms the modules compute (against the
functional ops and plain torch with the same weights)."""
import copy
import io
import json
import keyword
import math
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import nn as ann
from attnkit.models import Transformer

from conftest import rel_err

ops = torch.ops.attnkit
f64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)

# Closed forms computed here in float64 from the same float64 weights and
# inputs: the module's float64 path (composites, at::linear) differs from them
# only in summation order, ~1e-16 relative per operation; 1e-12 leaves room
# for chains of a few dozen such sums.
F64_TOL = 1e-12
# float32 module vs its float64 closed form (inputs and weights are float32
# values, so only the computation's rounding counts): sums of at most ~50
# float32 terms per stage and at most 3 stages, ~50 u = 3e-6 per stage in the
# worst case; 1e-5 (the C++ tests' bound for the float32 kernels).
F32_TOL = 1e-5


def lengths(*values):
    return torch.tensor(values, dtype=torch.int64)


def padding(lens, S):
    """key_padding_mask (N, S), True at keys j >= lens[n] (trailing padding)."""
    return torch.arange(S).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (in order)."""
    return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


# ---------------------------------------------------------------------------------------
# Bad input: a RuntimeError / ValueError naming the op or module and the argument
# ---------------------------------------------------------------------------------------

_GEN = torch.Generator().manual_seed(0)  # module-level inputs must not move the global RNG at collection


def _q(*s):
    return torch.randn(*s, generator=_GEN)


Q, K, V = _q(1, 2, 4, 3), _q(1, 2, 5, 3), _q(1, 2, 5, 2)
OFF, COL = ops.edge_pattern("local", 4, 1)
K4, V4 = _q(1, 2, 4, 3), _q(1, 2, 4, 2)
CQ, CR, VA = _q(1, 2, 4).abs(), _q(1, 2, 5).abs(), _q(1, 2, 5, 3)
FG, AG, BG = _q(1, 2, 4, 3), _q(1, 2, 4).abs(), _q(1, 2, 4).abs()

OP_ERRORS = [
    # softmax_attention
    ("softmax rank", lambda: ops.softmax_attention(Q[0], K, V), ("softmax_attention", "'q'", "4 dimensions")),
    ("softmax dtype", lambda: ops.softmax_attention(Q, K.double(), V), ("softmax_attention", "'k'", "dtype")),
    ("softmax float16", lambda: ops.softmax_attention(Q.half(), K.half(), V.half()), ("softmax_attention", "'q'", "float16")),
    ("softmax integer", lambda: ops.softmax_attention(Q.long(), K.long(), V.long()), ("softmax_attention", "'q'", "floating")),
    ("softmax E", lambda: ops.softmax_attention(Q, _q(1, 2, 5, 4), V), ("softmax_attention", "'k'", "feature size E")),
    ("softmax H", lambda: ops.softmax_attention(Q, _q(1, 3, 5, 3), V), ("softmax_attention", "'k' has head count 3",
                                                                       "must divide q's head count 2")),
    ("softmax S", lambda: ops.softmax_attention(Q, K, V[:, :, :4]), ("softmax_attention", "'v'", "key count S")),
    ("softmax M=0", lambda: ops.softmax_attention(Q, K, V[..., :0]), ("softmax_attention", "M must be positive")),
    ("softmax key_lengths dtype", lambda: ops.softmax_attention(Q, K, V, key_lengths=torch.tensor([2.0])),
     ("softmax_attention", "'key_lengths'", "int64")),
    ("softmax key_lengths shape", lambda: ops.softmax_attention(Q, K, V, key_lengths=lengths(2, 3)),
     ("softmax_attention", "'key_lengths'", "shape (1)")),
    ("softmax key_lengths negative", lambda: ops.softmax_attention(Q, K, V, key_lengths=lengths(-1)),
     ("softmax_attention", "'key_lengths'", "negative")),
    ("softmax key_lengths > S", lambda: ops.softmax_attention(Q, K, V, key_lengths=lengths(6)),
     ("softmax_attention", "'key_lengths'", "6 larger than", "5")),
    ("softmax bias shape", lambda: ops.softmax_attention(Q, K, V, bias=_q(1, 2, 4, 4)),
     ("softmax_attention", "'bias'", "broadcast")),
    ("softmax bias dtype", lambda: ops.softmax_attention(Q, K, V, bias=_q(1, 2, 4, 5).double()),
     ("softmax_attention", "'bias'", "dtype")),
    ("softmax scale nan", lambda: ops.softmax_attention(Q, K, V, scale=float("nan")), ("softmax_attention", "'scale'", "finite")),
    ("softmax scale > FLT_MAX", lambda: ops.softmax_attention(Q, K, V, scale=1e39), ("softmax_attention", "'scale'", "float32")),
    # linear_attention
    ("linear rank", lambda: ops.linear_attention(Q, K, V[0]), ("linear_attention", "'v'", "4 dimensions")),
    ("linear N", lambda: ops.linear_attention(Q, _q(2, 2, 5, 3), V), ("linear_attention", "'k'", "batch size N")),
    ("linear feature_map", lambda: ops.linear_attention(Q, K, V, feature_map="relu"),
     ("linear_attention", "'feature_map'", "'relu'")),
    ("linear eps negative", lambda: ops.linear_attention(Q, K, V, eps=-1.0), ("linear_attention", "'eps'", ">= 0")),
    ("linear eps inf", lambda: ops.linear_attention(Q, K, V, eps=float("inf")), ("linear_attention", "'eps'", "finite")),
    ("linear dtype", lambda: ops.linear_attention(Q, K, V.double()), ("linear_attention", "'v'", "dtype")),
    # gated_linear_attention
    ("gated rank", lambda: ops.gated_linear_attention(FG[0], FG[0], AG, BG), ("gated_linear_attention", "'f'", "4 dimensions")),
    ("gated q shape", lambda: ops.gated_linear_attention(FG, _q(1, 2, 4, 2), AG, BG), ("gated_linear_attention", "'q'", "shape")),
    ("gated alpha shape", lambda: ops.gated_linear_attention(FG, FG, _q(1, 2, 5).abs(), BG),
     ("gated_linear_attention", "'alpha'", "(N, H, L) = (1, 2, 4)")),
    ("gated beta rank", lambda: ops.gated_linear_attention(FG, FG, AG, BG.unsqueeze(-1)),
     ("gated_linear_attention", "'beta'", "3 dimensions")),
    ("gated dtype", lambda: ops.gated_linear_attention(FG, FG, AG.double(), BG), ("gated_linear_attention", "'alpha'", "dtype")),
    # agglomerative_attention
    ("agglomerative rank", lambda: ops.agglomerative_attention(CQ[0], CR, VA), ("agglomerative_attention", "'cq'", "3 dimensions")),
    ("agglomerative S", lambda: ops.agglomerative_attention(CQ, CR, VA[:, :, :4]), ("agglomerative_attention", "'v'", "length S")),
    ("agglomerative H", lambda: ops.agglomerative_attention(CQ, _q(1, 3, 5).abs(), VA), ("agglomerative_attention", "'cr'", "class count H")),
    ("agglomerative clip 0", lambda: ops.agglomerative_attention(CQ, CR, VA, clip=0.0), ("agglomerative_attention", "'clip'", "> 0")),
    ("agglomerative clip nan", lambda: ops.agglomerative_attention(CQ, CR, VA, clip=float("nan")),
     ("agglomerative_attention", "'clip'", "finite")),
    ("agglomerative clip subnormal", lambda: ops.agglomerative_attention(CQ, CR, VA, clip=1e-45),
     ("agglomerative_attention", "'clip'", "at least")),
    ("agglomerative dtype", lambda: ops.agglomerative_attention(CQ, CR.double(), VA), ("agglomerative_attention", "'cr'", "dtype")),
    # clustered_attention
    ("clustered rank", lambda: ops.clustered_attention(Q[0], K, V, clusters=2), ("clustered_attention", "'q'", "4 dimensions")),
    ("clustered clusters > L", lambda: ops.clustered_attention(Q, K, V, clusters=5), ("clustered_attention", "'clusters' (5)", "L = 4")),
    ("clustered clusters 0", lambda: ops.clustered_attention(Q, K, V, clusters=0), ("clustered_attention", "'clusters'", ">= 1")),
    ("clustered bits", lambda: ops.clustered_attention(Q, K, V, clusters=2, bits=64), ("clustered_attention", "'bits'", "[1, 63]")),
    ("clustered topk > S", lambda: ops.clustered_attention(Q, K, V, clusters=2, topk=6), ("clustered_attention", "'topk' (6)", "S = 5")),
    ("clustered topk negative", lambda: ops.clustered_attention(Q, K, V, clusters=2, topk=-1), ("clustered_attention", "'topk'", ">= 0")),
    ("clustered iterations", lambda: ops.clustered_attention(Q, K, V, clusters=2, iterations=1001),
     ("clustered_attention", "'iterations'", "[0, 1000]")),
    ("clustered query_lengths", lambda: ops.clustered_attention(Q, K, V, clusters=2, query_lengths=lengths(5)),
     ("clustered_attention", "'query_lengths'", "5 larger")),
    # sparse_attention and its edge lists
    ("sparse rank", lambda: ops.sparse_attention(Q[0], K4, V4, OFF, COL), ("sparse_attention", "'q'", "4 dimensions")),
    ("sparse offsets length", lambda: ops.sparse_attention(Q, K4, V4, OFF[:-1], COL),
     ("sparse_attention", "'offsets'", "L + 1 = 5")),
    ("sparse offsets start/end", lambda: ops.sparse_attention(Q, K4, V4, OFF + 1, COL),
     ("sparse_attention", "'offsets'", "start at 0")),
    ("sparse offsets decreasing", lambda: ops.sparse_attention(Q, K4, V4, torch.tensor([[0, 2, 1, 3, 3], [0, 1, 1, 2, 3]]),
                                                               torch.tensor([0, 1, 2])),
     ("sparse_attention", "'offsets'", "non-decreasing")),
    ("sparse offsets rank", lambda: ops.sparse_attention(Q, K4, V4, OFF.view(1, 1, -1), COL),
     ("sparse_attention", "'offsets'", "(L+1) or (H, L+1)")),
    ("sparse per-head rows", lambda: ops.sparse_attention(Q, K4, V4, torch.stack([OFF] * 3), COL),
     ("sparse_attention", "'offsets'", "H = 2 rows")),
    ("sparse offsets int32", lambda: ops.sparse_attention(Q, K4, V4, OFF.int(), COL), ("sparse_attention", "'offsets'", "int64")),
    ("sparse columns int32", lambda: ops.sparse_attention(Q, K4, V4, OFF, COL.int()), ("sparse_attention", "'columns'", "int64")),
    ("sparse columns 2-D", lambda: ops.sparse_attention(Q, K4, V4, OFF, COL.view(1, -1)), ("sparse_attention", "'columns'", "1-D")),
    ("sparse columns range", lambda: ops.sparse_attention(Q, K4[:, :, :2], V4[:, :, :2], OFF, COL),
     ("sparse_attention", "'columns'", "outside the key range [0, 2)")),
    ("sparse columns unsorted", lambda: ops.sparse_attention(Q, K4, V4, OFF, COL[[1, 0] + list(range(2, COL.numel()))]),
     ("sparse_attention", "'columns'", "strictly increasing")),
    ("sparse columns duplicate", lambda: ops.sparse_attention(Q, K4, V4, torch.tensor([0, 2, 2, 2, 2]), torch.tensor([1, 1])),
     ("sparse_attention", "'columns'", "strictly increasing")),
    ("edge_pattern name", lambda: ops.edge_pattern("nope", 4), ("edges::by_name", "'nope'")),
    ("edge_pattern span", lambda: ops.edge_pattern("local", 4, -1), ("edges::local", "'span'", ">= 0")),
    ("edge_pattern segment 0", lambda: ops.edge_pattern("segments", 4), ("edges::segments", "'segment'", ">= 1")),
    ("edge_pattern star n", lambda: ops.edge_pattern("star", 0), ("edges::star", "'n'")),
    # linear
    ("linear-op in", lambda: ops.linear(_q(3, 6), _q(4, 5)), ("linear", "'weight'", "in = 5")),
    ("linear-op bias shape", lambda: ops.linear(_q(3, 5), _q(4, 5), _q(3)), ("linear", "'bias'", "shape (4)")),
    ("linear-op weight dtype", lambda: ops.linear(_q(3, 5), _q(4, 5).double()), ("linear", "'weight'", "dtype")),
    ("linear-op bias dtype", lambda: ops.linear(_q(3, 5), _q(4, 5), _q(4).double()), ("linear", "'bias'", "dtype")),
    ("linear-op weight rank", lambda: ops.linear(_q(3, 5), _q(5)), ("linear", "'weight'", "2 dimensions")),
    ("linear-op 0-d x", lambda: ops.linear(torch.tensor(1.0), _q(4, 1)), ("linear", "'x'", "0-dimensional")),
]


@pytest.mark.parametrize("call, fragments", [pytest.param(c, f, id=i) for i, c, f in OP_ERRORS])
def test_op_bad_input_raises_naming_op_and_argument(call, fragments):
    with raises(RuntimeError, *fragments):
        call()


def _with_weight(module, weight):
    module.weight = torch.nn.Parameter(weight)
    return module


X = _q(2, 5, 8)
with torch.random.fork_rng(devices=[]):
    MHA = ann.MultiheadAttention(8, 2, batch_first=True)

MODULE_ERRORS = [
    ("MHA rank", lambda: MHA(X[0], X, X), RuntimeError, ("MultiheadAttention", "'query'", "3 dimensions")),
    ("MHA feature size", lambda: MHA(_q(2, 5, 7), X, X), RuntimeError, ("MultiheadAttention", "'query'", "feature size 7")),
    ("MHA batch", lambda: MHA(X, X[:1], X[:1]), RuntimeError, ("MultiheadAttention", "'key'", "batch size")),
    ("MHA value length", lambda: MHA(X, X, X[:, :4]), RuntimeError, ("MultiheadAttention", "'value'", "length S")),
    ("MHA non-causal attn_mask", lambda: MHA(X, X, X, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril()), ValueError,
     ("MultiheadAttention", "attn_mask", "causal")),
    ("MHA float attn_mask", lambda: MHA(X, X, X, attn_mask=torch.randn(5, 5)), ValueError, ("MultiheadAttention", "attn_mask")),
    ("MHA attn_mask shape", lambda: MHA(X, X, X, attn_mask=torch.ones(4, 5, dtype=torch.bool).triu(2)), ValueError,
     ("MultiheadAttention", "attn_mask", "(5, 5)")),
    ("MHA leading padding", lambda: MHA(X, X, X, key_padding_mask=~padding([5, 4], 5)), ValueError,
     ("MultiheadAttention", "key_padding_mask", "end")),
    ("MHA padding hole", lambda: MHA(X, X, X, key_padding_mask=torch.tensor([[False, True, False, False, False]] * 2)),
     ValueError, ("MultiheadAttention", "key_padding_mask")),
    ("MHA float padding values", lambda: MHA(X, X, X, key_padding_mask=torch.ones(2, 5)), ValueError,
     ("MultiheadAttention", "key_padding_mask", "-inf")),
    ("MHA padding rank", lambda: MHA(X, X, X, key_padding_mask=torch.zeros(5, dtype=torch.bool)), ValueError,
     ("MultiheadAttention", "key_padding_mask", "(N, S)")),
    ("MHA need_weights", lambda: ann.MultiheadAttention(8, 2, attention="linear", batch_first=True)(
        X, X, X, need_weights=True), ValueError, ("MultiheadAttention", "need_weights", "'full'", "'linear'")),
    ("MHA mask and lengths", lambda: MHA(X, X, X, key_padding_mask=padding([5, 5], 5), key_lengths=lengths(5, 5)),
     ValueError, ("MultiheadAttention", "key_padding_mask", "key_lengths")),
    ("MHA key_lengths", lambda: MHA(X, X, X, key_lengths=lengths(6, 5)), RuntimeError, ("'key_lengths'", "6 larger")),
    ("MHA embed_dim", lambda: ann.MultiheadAttention(7, 2), RuntimeError, ("MultiheadAttention", "width (7)", "heads (2)")),
    ("MHA mechanism", lambda: ann.MultiheadAttention(8, 2, attention="nope"), RuntimeError, ("attention mechanism", "'nope'")),
    ("MHA mechanism option", lambda: ann.MultiheadAttention(8, 2, attention="clustered:topk=3"), RuntimeError,
     ("'clustered'", "'topk'")),
    ("MHA set_attention", lambda: copy.deepcopy(MHA).set_attention("bogus"), RuntimeError, ("attention mechanism", "'bogus'")),
    ("Attention spec", lambda: ann.Attention("bogus"), RuntimeError, ("attention mechanism", "'bogus'")),
    ("Attention option value", lambda: ann.Attention("clustered", clusters=-1), RuntimeError, ("clustered", "'clusters'", ">= 1")),
    ("Attention shapes", lambda: ann.Attention("full")(_q(1, 2, 3, 4), _q(1, 2, 3, 5), _q(1, 2, 3, 4)), RuntimeError,
     ("full", "'k'", "feature size E")),
    ("Attention unsupported key_lengths", lambda: ann.Attention("linear")(Q, K, V, key_lengths=lengths(2)), RuntimeError,
     ("linear", "key_lengths")),
    ("Attention self-attention only", lambda: ann.registry.SparseLocal(span=1)(Q, K, V), RuntimeError,
     ("sparse-local", "L == S")),
    ("registry option value", lambda: ann.registry.SparseLocal(span="x"), RuntimeError, ("sparse-local", "'span'", "integer")),
    ("MHA float16", lambda: ann.MultiheadAttention(8, 2, batch_first=True).half()(X.half(), X.half(), X.half()), RuntimeError,
     ("MultiheadAttention", "'query'", "float16")),
    ("MHA mechanism without causal", lambda: ann.MultiheadAttention(8, 2, attention="clustered", batch_first=True)(
        X, X, X, is_causal=True), RuntimeError, ("clustered", "causal")),
    ("MHA mechanism without padding", lambda: ann.MultiheadAttention(8, 2, attention="sparse-local", batch_first=True)(
        X, X, X, key_padding_mask=padding([5, 4], 5)), RuntimeError, ("sparse-local", "key_lengths")),
    ("Attention gated-linear M != E", lambda: ann.Attention("gated-linear")(Q, K, V), RuntimeError, ("gated-linear", "M == E")),
    ("Linear replaced parameter shape", lambda: _with_weight(ann.Linear(3, 2), torch.randn(2, 4))(torch.randn(1, 3)),
     RuntimeError, ("'weight'", "Linear", "replaced")),
    ("AdditiveAttention rank", lambda: ann.AdditiveAttention(6, 4, 9)(_q(3, 6), _q(2, 5, 4), _q(2, 5, 7)), RuntimeError,
     ("AdditiveAttention", "'query'", "3 dimensions")),
    ("AdditiveAttention keys", lambda: ann.AdditiveAttention(6, 4, 9)(_q(2, 3, 6), _q(2, 5, 3), _q(2, 5, 7)), RuntimeError,
     ("AdditiveAttention", "'keys'", "feature size 3")),
    ("AdditiveAttention values", lambda: ann.AdditiveAttention(6, 4, 9)(_q(2, 3, 6), _q(2, 5, 4), _q(2, 4, 7)), RuntimeError,
     ("AdditiveAttention", "'values'", "key count S")),
    ("AdditiveAttention key_lengths", lambda: ann.AdditiveAttention(6, 4, 9)(_q(2, 3, 6), _q(2, 5, 4), _q(2, 5, 7),
                                                                            key_lengths=torch.tensor([1.0, 1.0])),
     RuntimeError, ("AdditiveAttention", "'key_lengths'", "int64")),
    ("AdditiveAttention sizes", lambda: ann.AdditiveAttention(0, 4, 9), RuntimeError, ("AdditiveAttention", "positive")),
    ("GeneralAttention keys", lambda: ann.GeneralAttention(6, 4)(_q(2, 3, 6), _q(2, 5, 3), _q(2, 5, 7)), RuntimeError,
     ("GeneralAttention", "'keys'")),
    ("DotAttention keys", lambda: ann.DotAttention()(_q(2, 3, 6), _q(2, 5, 4), _q(2, 5, 7)), RuntimeError,
     ("DotAttention", "'keys'", "expected 6")),
    ("LocationAttention length", lambda: ann.LocationAttention(6, 5)(_q(2, 3, 6), _q(2, 6, 3)), RuntimeError,
     ("LocationAttention", "6 exceeds max_source_length 5")),
    ("RelativePositionAttention x", lambda: ann.RelativePositionAttention(8, 2, 3)(_q(2, 5, 6)), RuntimeError,
     ("RelativePositionAttention", "'x'", "feature size 6")),
    ("RelativePositionAttention heads", lambda: ann.RelativePositionAttention(7, 2, 3), RuntimeError,
     ("RelativePositionAttention", "(7)", "heads (2)")),
    ("SinusoidalPositionalEncoding max_length", lambda: ann.SinusoidalPositionalEncoding(5, 10)(_q(1, 3, 5), offset=8),
     RuntimeError, ("SinusoidalPositionalEncoding", "[8, 11)", "max_length 10")),
    ("SinusoidalPositionalEncoding negative offset", lambda: ann.SinusoidalPositionalEncoding(5, 10)(_q(1, 3, 5), offset=-1),
     RuntimeError, ("SinusoidalPositionalEncoding", "[-1, 2)")),
    ("SinusoidalPositionalEncoding x", lambda: ann.SinusoidalPositionalEncoding(5, 10)(_q(1, 3, 4)), RuntimeError,
     ("SinusoidalPositionalEncoding", "'x'", "feature size 4")),
    ("AgglomerativeAttention query", lambda: ann.AgglomerativeAttention(8, 2)(_q(2, 5, 6)), RuntimeError,
     ("AgglomerativeAttention", "'x_query'")),
    ("AgglomerativeAttention reference", lambda: ann.AgglomerativeAttention(8, 2)(_q(2, 5, 8), _q(3, 4, 8)), RuntimeError,
     ("AgglomerativeAttention", "'x_ref'", "batch size")),
    ("AgglomerativeAttention classes", lambda: ann.AgglomerativeAttention(7, 2), RuntimeError,
     ("AgglomerativeAttention", "(7)", "classes (2)")),
    ("LinearAttention feature_map", lambda: ann.LinearAttention(feature_map="relu"), RuntimeError, ("'feature_map'", "'relu'")),
    ("GatedLinearAttention hidden", lambda: ann.GatedLinearAttention(4)(_q(2, 5, 3), _q(2, 3, 3)), RuntimeError,
     ("GatedLinearAttention", "'hidden'", "feature size")),
    ("Linear in_features", lambda: ann.Linear(3, 2)(_q(4, 5)), RuntimeError, ("linear", "'weight'", "in = 3")),
    ("Linear integer input", lambda: ann.Linear(3, 2)(torch.ones(4, 3, dtype=torch.long)), RuntimeError, ("Linear", "'input'", "dtype Long")),
    ("Transformer width", lambda: Transformer(5, width=7, heads=2), RuntimeError, ("Transformer", "width (7)", "heads (2)")),
    ("Transformer mechanism", lambda: Transformer(5, attention="bogus"), RuntimeError, ("attention mechanism", "'bogus'")),
    ("Transformer architecture", lambda: Transformer(5, architecture="x"), RuntimeError, ("architecture", "'x'")),
    ("Transformer tokens dtype", lambda: Transformer(5, layers=1, width=4, heads=2)(torch.tensor([[1.0, 2.0]])),
     RuntimeError, ("Transformer", "'tokens'", "int64")),
    ("Transformer token range", lambda: Transformer(5, layers=1, width=4, heads=2)(torch.tensor([[1, 7]])),
     RuntimeError, ("Transformer", "'tokens'", "[0, 5)")),
    ("DocumentMemory dim", lambda: ann.DocumentMemory(0), RuntimeError, ("DocumentMemory", "'dim'", "positive")),
    ("DocumentMemory append", lambda: ann.DocumentMemory(4).append(_q(3, 5)), RuntimeError,
     ("DocumentMemory::append", "'hidden'", "expected 4")),
    ("DocumentMemory append dtype", lambda: ann.DocumentMemory(4).append(_q(3, 4).double()), RuntimeError,
     ("DocumentMemory::append", "'hidden'", "float32")),
    ("DocumentMemory lookup", lambda: ann.DocumentMemory(4).lookup(_q(3)), RuntimeError,
     ("DocumentMemory::lookup", "'queries'", "2 dimensions")),
    ("DocumentMemory merge", lambda: ann.DocumentMemory(4).merge(ann.DocumentMemory(3)), RuntimeError,
     ("DocumentMemory::merge", "k = 3", "k = 4")),
    ("DocumentMemory missing file", lambda: ann.DocumentMemory.load("/nonexistent/attnkit-memory.bin"), RuntimeError,
     ("DocumentMemory::load", "'/nonexistent/attnkit-memory.bin'")),
    ("DocumentMemory pickle", lambda: pickle.dumps(ann.DocumentMemory(3)), TypeError, ("DocumentMemory", "save")),
    # Unknown keyword options: TypeError, Python's error for an unexpected keyword argument.
    ("registry unknown option", lambda: ann.registry.Clustered(topk=3), TypeError,
     ("attnkit.nn.registry.Clustered", "unknown option", "topk", "clusters")),
    ("Transformer unknown option", lambda: Transformer(5, foo=1), TypeError, ("attnkit.models.Transformer", "unknown option", "foo")),
    ("Transformer.from_kwargs vocab_size", lambda: Transformer.from_kwargs(layers=1), TypeError, ("from_kwargs", "vocab_size")),
]


@pytest.mark.parametrize("call, exc, fragments", [pytest.param(c, e, f, id=i) for i, c, e, f in MODULE_ERRORS])
def test_module_bad_input_raises_naming_module_and_argument(call, exc, fragments):
    with raises(exc, *fragments):
        call()


@pytest.mark.parametrize("module, call", [
    pytest.param(lambda: ann.AgglomerativeAttention(8, 2), lambda m, x: m(x), id="AgglomerativeAttention"),
    pytest.param(lambda: ann.MultiheadAttention(8, 2), lambda m, x: m(x, x, x), id="MultiheadAttention"),
    pytest.param(lambda: ann.Linear(8, 3), lambda m, x: m(x), id="Linear"),
    pytest.param(lambda: ann.GeneralAttention(8, 8), lambda m, x: m(x, x, x), id="GeneralAttention"),
    pytest.param(lambda: ann.AdditiveAttention(8, 8, 4), lambda m, x: m(x, x, x), id="AdditiveAttention"),
    pytest.param(lambda: ann.RelativePositionAttention(8, 2, 2), lambda m, x: m(x), id="RelativePositionAttention"),
    pytest.param(lambda: ann.GatedLinearAttention(8), lambda m, x: m(x, x), id="GatedLinearAttention"),
])
def test_module_dtype_mismatch_names_the_module(module, call):
    """A float64 input to a float32 module: the error names the module and the
    input (AgglomerativeAttention: "argument 'x_query' has dtype Double but the
    parameters have dtype Float")."""
    m = module()
    name = type(m).__name__
    with pytest.raises(RuntimeError) as info:
        call(m, torch.randn(2, 5, 8, dtype=f64))
    assert name in str(info.value) and "dtype" in str(info.value), str(info.value)


def test_key_padding_mask_of_the_wrong_length_is_refused():
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    with raises(ValueError, "MultiheadAttention", "key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------
# The torch.nn.Module contract
# ---------------------------------------------------------------------------------------

def _contract_cases():
    """(id, factory, inputs factory, call); calls are deterministic in eval mode."""
    cases = []

    def add(name, make, inputs, call):
        cases.append(pytest.param(make, inputs, call, id=name))

    add("Linear", lambda: ann.Linear(5, 3), lambda: [torch.randn(2, 5)], lambda m, x: m(x))
    add("MultiheadAttention", lambda: ann.MultiheadAttention(8, 2, batch_first=True),
        lambda: [torch.randn(2, 5, 8)], lambda m, x: m(x, x, x, is_causal=True)[0])
    add("MultiheadAttention improved-clustered", lambda: ann.MultiheadAttention(
        8, 2, attention="improved-clustered:clusters=2,topk=3,seed=7", batch_first=True),
        lambda: [torch.randn(2, 6, 8)], lambda m, x: m(x, x, x)[0])
    add("AdditiveAttention", lambda: ann.AdditiveAttention(4, 3, 5), lambda: [torch.randn(2, 3, 4), torch.randn(2, 6, 3)],
        lambda m, q, k: m(q, k, k)[0])
    add("GeneralAttention", lambda: ann.GeneralAttention(4, 3), lambda: [torch.randn(2, 3, 4), torch.randn(2, 6, 3)],
        lambda m, q, k: m(q, k, k)[0])
    add("LocationAttention", lambda: ann.LocationAttention(4, 7), lambda: [torch.randn(2, 3, 4), torch.randn(2, 6, 3)],
        lambda m, q, v: m(q, v)[0])
    add("RelativePositionAttention", lambda: ann.RelativePositionAttention(8, 2, 2), lambda: [torch.randn(2, 5, 8)],
        lambda m, x: m(x, causal=True))
    add("AgglomerativeAttention", lambda: ann.AgglomerativeAttention(8, 2), lambda: [torch.randn(2, 5, 8)],
        lambda m, x: m(x, causal=True))
    add("GatedLinearAttention", lambda: ann.GatedLinearAttention(4), lambda: [torch.randn(2, 5, 4)],
        lambda m, x: m(x, x, causal=True))
    add("Transformer", lambda: Transformer(7, layers=2, width=8, heads=2, ffn=12, dropout=0.0,
                                           attention=["full", "linear"]),
        lambda: [torch.tensor([[1, 2, 3, 4], [5, 6, 0, 1]])], lambda m, t: m(t))
    return cases


CONTRACT = _contract_cases()


def _perturbed(module):
    """The module with every parameter moved off its initial value (so that a
    load that does nothing cannot pass)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_state_dict_round_trip(make, make_inputs, call):
    a = _perturbed(make()).eval()
    b = make().eval()
    xs = make_inputs()
    assert not torch.equal(call(a, *xs), call(b, *xs))
    state = a.state_dict()
    assert list(state) == [n for n, _ in a.named_parameters()] + [n for n, _ in a.named_buffers()]
    b.load_state_dict(state)
    assert torch.equal(call(a, *xs), call(b, *xs))
    # through a file, as users save checkpoints
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c = make().eval()
    c.load_state_dict(torch.load(buf))
    assert torch.equal(call(a, *xs), call(c, *xs))


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_deepcopy_is_equal_and_independent(make, make_inputs, call):
    a = _perturbed(make()).eval()
    xs = make_inputs()
    b = copy.deepcopy(a)
    assert torch.equal(call(a, *xs), call(b, *xs))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and pa is not pb and pa.data_ptr() != pb.data_ptr()
    before = call(a, *xs)
    with torch.no_grad():
        next(b.parameters()).add_(1.0)
    assert torch.equal(call(a, *xs), before)
    assert not torch.equal(call(b, *xs), before)


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_pickle_round_trip_keeps_outputs_and_the_global_rng(make, make_inputs, call):
    a = _perturbed(make()).eval()
    xs = make_inputs()
    blob = pickle.dumps(a)
    state = torch.get_rng_state()
    b = pickle.loads(blob)
    assert torch.equal(torch.get_rng_state(), state), "unpickling moved torch's global RNG"
    assert torch.equal(call(a, *xs), call(b, *xs))
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    state = torch.get_rng_state()
    c = torch.load(buf, weights_only=False)  # a whole module (torch 2.6's default loads tensors only)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(call(a, *xs), call(c, *xs))
    assert type(b) is type(a) and b.extra_repr() == a.extra_repr()  # the C++ settings came along


def test_pickle_keeps_the_clustered_call_counter():
    """A clustered mechanism draws fresh planes per training call (seed + calls);
    the counter is a buffer, so a pickled module continues the same sequence
    rather than restarting it."""
    a = ann.MultiheadAttention(8, 2, attention="clustered:clusters=2,bits=3,seed=3", batch_first=True)
    fresh = copy.deepcopy(a)
    x = torch.randn(1, 16, 8)
    first = a(x, x, x)[0]
    b = pickle.loads(pickle.dumps(a))
    assert int(b.state_dict()["attention.clustered.calls"]) == 1
    second = b(x, x, x)[0]
    assert torch.equal(second, a(x, x, x)[0])
    assert torch.equal(fresh(x, x, x)[0], first)
    assert not torch.equal(first, second), "seeds 3 and 4 give the same labels here: pick other data"
    assert int(a.state_dict()["attention.clustered.calls"]) == int(b.state_dict()["attention.clustered.calls"]) == 2


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_to_float64_then_forward(make, make_inputs, call):
    a = _perturbed(make()).eval()
    xs = make_inputs()
    out32 = call(a, *xs)
    b = copy.deepcopy(a).to(f64)
    assert all(p.dtype == f64 for p in b.parameters())
    xs64 = [x.double() if x.is_floating_point() else x for x in xs]
    out64 = call(b, *xs64)
    assert out64.dtype == f64
    # float32 vs float64 of the same weights: the tolerance of test_gradcheck.py's modules (5e-5)
    assert rel_err(out32, out64) <= 5e-5
    # and back: float32 again gives the float32 result (the weights went through float64 exactly)
    c = b.to(torch.float32)
    assert torch.equal(call(c, *xs), out32)


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_optimizer_step_changes_the_output(make, make_inputs, call):
    """The Parameters are the C++ module's tensors: an optimizer that updates
    them in place changes what the C++ forward computes."""
    m = make()
    m.eval()
    xs = make_inputs()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = call(m, *xs).detach()
    call(m, *xs).pow(2).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    opt.step()
    after = call(m, *xs).detach()
    assert (after - before).abs().max() > 1e-3


def test_optimizer_step_is_the_closed_form_update():
    m = ann.Linear(4, 3)
    x = torch.randn(5, 4)
    w0, b0 = m.weight.detach().clone(), m.bias.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x).sum().backward()
    opt.step()
    # d sum(x W^T + b) / dW = 1^T x, / db = N
    w1 = w0 - 0.1 * torch.ones(3, 5) @ x
    b1 = b0 - 0.1 * 5
    torch.testing.assert_close(m.weight.detach(), w1)
    torch.testing.assert_close(m(x), F.linear(x, w1, b1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make, make_inputs, call", CONTRACT)
def test_frozen_parameters_get_no_gradient(make, make_inputs, call):
    m = make().eval()
    xs = make_inputs()
    params = list(m.named_parameters())
    frozen = {n for i, (n, _) in enumerate(params) if i % 2 == 0}
    for n, p in params:
        p.requires_grad_(n not in frozen)
    xs = [x.requires_grad_() if x.is_floating_point() else x for x in xs]  # a graph even if all are frozen
    call(m, *xs).pow(2).sum().backward()
    for n, p in params:
        if n in frozen:
            assert p.grad is None, n
        else:
            assert p.grad is not None, n
            # k_proj.bias's exact gradient is 0 under a softmax over keys (test_gradcheck.py)
            assert p.grad.abs().sum() > 0 or n.endswith("k_proj.bias"), n
    # Everything frozen and no input needs grad: no graph at all.
    for _, p in params:
        p.requires_grad_(False)
    assert not call(m, *[x.detach() for x in xs]).requires_grad


def test_frozen_input_and_trainable_parameters():
    m = ann.MultiheadAttention(4, 2, batch_first=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    y = torch.randn(2, 3, 4)
    m(x, y, y)[0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert m.q_proj.weight.grad is not None


def test_gradients_accumulate_over_calls_and_shared_inputs():
    m = ann.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=f64, requires_grad=True)
    m(x, x, x)[0].sum().backward()
    once = {n: p.grad.clone() for n, p in m.named_parameters()}
    x_once = x.grad.clone()
    # the same tensor as query, key and value: the sum of the three input gradients
    parts = [x.detach().clone().requires_grad_() for _ in range(3)]
    m.zero_grad()
    m(*parts)[0].sum().backward()
    assert rel_err(parts[0].grad + parts[1].grad + parts[2].grad, x_once) <= F64_TOL
    # two calls in one graph: twice the gradients
    m.zero_grad()
    (m(x, x, x)[0].sum() + m(x, x, x)[0].sum()).backward()
    for n, p in m.named_parameters():
        assert rel_err(p.grad, 2 * once[n]) <= F64_TOL or once[n].abs().max() < 1e-12, n


@pytest.mark.parametrize("shape_q, shape_kv", [((0, 5, 8), (0, 5, 8)), ((2, 0, 8), (2, 5, 8)), ((2, 3, 8), (2, 0, 8))])
def test_multihead_empty_sizes(shape_q, shape_kv):
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    q, kv = torch.randn(*shape_q), torch.randn(*shape_kv)
    out = m(q, kv, kv)[0]
    assert out.shape == shape_q
    if shape_kv[1] == 0 and shape_q[1] > 0:  # no key at all: out_proj's bias
        assert torch.equal(out, m.out_proj.bias.detach().expand(*shape_q))


def test_bfloat16_module():
    """The composites run bfloat16 (docs/API.md): 8 significant bits, unit
    roundoff 2^-9 = 2e-3; a few dozen rounded operations on O(1) values: 5e-2
    relative (the C++ tests' bfloat16 bound)."""
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    out = copy.deepcopy(m).to(torch.bfloat16)(*(x.bfloat16(),) * 3)[0]
    assert out.dtype == torch.bfloat16
    assert rel_err(out, m(x, x, x)[0]) <= 5e-2


def test_dropout_follows_the_training_mode_and_torch_seed():
    a = ann.AgglomerativeAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 5, 8)
    torch.manual_seed(5)
    y1 = a(x)
    torch.manual_seed(5)
    assert torch.equal(a(x), y1)
    assert not torch.equal(a(x), y1)
    a.eval()
    assert torch.equal(a(x), a(x))
    no_dropout = ann.AgglomerativeAttention(8, 2)
    no_dropout.load_state_dict(a.state_dict())
    assert torch.equal(a(x), no_dropout(x))


def test_attention_dropout_follows_the_training_mode_and_torch_seed():
    m = ann.MultiheadAttention(8, 2, batch_first=True, dropout=0.5)
    plain = ann.MultiheadAttention(8, 2, batch_first=True)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 6, 8)
    torch.manual_seed(5)
    y1 = m(x, x, x)[0]
    torch.manual_seed(5)
    assert torch.equal(m(x, x, x)[0], y1)
    assert not torch.equal(m(x, x, x)[0], y1)
    assert not torch.allclose(y1, plain(x, x, x)[0])
    m.eval()
    assert torch.equal(m(x, x, x)[0], plain(x, x, x)[0])
    with pytest.raises(RuntimeError, match="dropout"):
        ann.MultiheadAttention(8, 2, attention="linear", dropout=0.1)


def test_attention_dropout_mask_is_what_the_kernel_keeps():
    # v = identity: the output is P * Z / (1 - p), zero exactly where Z drops
    q, k = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 9, 4)
    v = torch.eye(9).expand(1, 2, 9, 9)
    out = attnkit.softmax_attention(q, k, v, dropout_p=0.3, dropout_seed=42)
    keep = attnkit.attention_dropout_mask(1, 2, 7, 9, 0.3, 42)
    assert keep.dtype == torch.bool and keep.shape == (1, 2, 7, 9)
    assert torch.equal(out != 0, keep)
    p = attnkit.softmax_attention(q, k, v)
    keep_rate = 1 - round(0.3 * 2**16) / 2**16  # the probability, rounded to a multiple of 2^-16
    assert torch.allclose(out, p * keep / keep_rate, rtol=1e-6, atol=1e-8)


def test_transformer_generate_is_repeatable():
    t = Transformer(7, layers=1, width=8, heads=2, ffn=8)
    prompt = torch.tensor([[1, 2], [3, 4]])
    a = t.generate(prompt, tokens=5, seed=3)
    assert a.shape == (2, 7) and torch.equal(a[:, :2], prompt)
    assert torch.equal(t.generate(prompt, tokens=5, seed=3), a)
    assert ((a >= 0) & (a < 7)).all()
    greedy = t.generate(prompt, tokens=3, temperature=0.0)
    t.eval()
    # greedy decoding picks the argmax of the full forward's last logits
    assert torch.equal(greedy[:, 2], t(prompt)[:, -1].argmax(-1))


def _replaced_weight(m):
    m.weight = torch.nn.Parameter(m.weight.detach().clone())
    return m


@pytest.mark.parametrize("make", [
    pytest.param(lambda: ann.Linear(3, 2), id="fresh"),
    pytest.param(lambda: ann.Linear(3, 2).double(), id="double"),
    pytest.param(lambda: _loaded(ann.Linear(3, 2)), id="load_state_dict"),
    pytest.param(lambda: copy.deepcopy(ann.Linear(3, 2)), id="deepcopy"),
    pytest.param(lambda: pickle.loads(pickle.dumps(ann.Linear(3, 2))), id="pickle"),
])
def test_in_place_update_between_forward_and_backward_is_detected(make):
    """As in torch: a parameter saved for the backward and changed in place
    before it (e.g. an optimizer step on a stale graph) raises, rather than
    giving gradients of weights the forward did not use."""
    m = make()
    x = torch.randn(4, 3, dtype=m.weight.dtype, requires_grad=True)
    y = m(x)
    with torch.no_grad():
        m.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_replaced_parameter_is_refused_at_the_next_call():
    """The C++ module computes with its own tensors: a Parameter replaced by a
    new tensor would be ignored, so the call refuses it and says what to do."""
    m = _replaced_weight(ann.Linear(3, 2))
    with raises(RuntimeError, "weight", "Linear", "replaced", "copy_"):
        m(torch.randn(4, 3))


def _loaded(m):
    m.load_state_dict(ann.Linear(3, 2).state_dict())
    return m


def test_in_place_edit_of_a_parameter_reaches_the_cpp_module():
    m = ann.Linear(3, 2)
    x = torch.randn(4, 3)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.fill_(2.0)
    assert torch.equal(m(x), torch.full((4, 2), 2.0))


def test_set_attention_swaps_the_mechanism_and_keeps_the_projections():
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 6, 8)
    params = dict(m.named_parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    full = m(x, x, x)[0]
    m.set_attention("linear:feature_map=elu,normalize=true")
    assert m.attention_spec == "linear:feature_map=elu,normalize=true"
    assert dict(m.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in m.named_parameters()), "set_attention replaced the Parameters"
    swapped = m(x, x, x)[0]
    assert not torch.allclose(swapped, full)
    # what a fresh module with this mechanism and the same weights computes
    fresh = ann.MultiheadAttention(8, 2, attention="linear:feature_map=elu,normalize=true", batch_first=True)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(x, x, x)[0], swapped)
    # the optimizer made before the swap still trains the module
    swapped.pow(2).sum().backward()
    opt.step()
    assert not torch.equal(m(x, x, x)[0], swapped)
    m.set_attention("full")
    fresh_full = ann.MultiheadAttention(8, 2, batch_first=True)
    fresh_full.load_state_dict(m.state_dict())
    assert torch.equal(m(x, x, x)[0], fresh_full(x, x, x)[0])


def test_transformer_set_attention_and_options():
    t = Transformer(7, layers=2, width=8, heads=2, ffn=12, dropout=0.0).eval()
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    params = dict(t.named_parameters())
    before = t(tokens)
    t.set_attention(["full", "causal-linear"])
    assert t.options["attention"] == ["full", "causal-linear"]
    assert all(p is params[n] for n, p in t.named_parameters())
    after = t(tokens)
    assert after.shape == (1, 5, 7) and not torch.allclose(before, after)
    u = Transformer.from_kwargs(vocab_size=7, layers=2, width=8, heads=2, ffn=12, dropout=0.0,
                                attention=["full", "causal-linear"]).eval()
    u.load_state_dict(t.state_dict())
    assert torch.equal(u(tokens), after)


# ---------------------------------------------------------------------------------------
# attnkit.nn.registry: one class per registry entry
# ---------------------------------------------------------------------------------------

def _camel(name):
    """The documented class names: CamelCase, and 'Attention' appended to a
    Python keyword ('none' is NoneAttention)."""
    camel = "".join(part[:1].upper() + part[1:] for part in name.split("-"))
    return camel + "Attention" if keyword.iskeyword(camel) else camel


def test_a_mechanism_class_for_every_registry_entry():
    entries = attnkit.mechanisms()
    assert {"full", "linear", "clustered", "improved-clustered", "sparse-local", "agglomerative", "sac"} <= {
        e["name"] for e in entries}
    expected = {_camel(e["name"]) for e in entries if not e["layer_only"]}
    assert set(ann.registry.__all__) == expected
    for e in entries:
        cls = getattr(ann.registry, _camel(e["name"]), None)
        if e["layer_only"]:
            assert cls is None
            continue
        assert isinstance(cls, type) and issubclass(cls, ann.Attention) and issubclass(cls, torch.nn.Module)
        assert e["name"] in cls.__doc__
        for option in e["options"]:
            assert option["key"] in cls.__doc__
    assert ann.AgglomerativeAttention  # the layer-only mechanism is a layer


def _mechanism_options(name):
    return {"clustered": {"clusters": 3, "seed": 2}, "improved-clustered": {"clusters": 2, "topk": 3, "seed": 1},
            "sparse-local": {"span": 2}, "sparse-local-causal": {"span": 2}, "sparse-segments": {"segment": 3},
            "sparse-segments-causal": {"segment": 3}, "sparse-strided": {"stride": 2},
            "sparse-random": {"edges": 2},
            "linear": {"feature_map": "identity", "normalize": False}, "sac": {"seed": 3}}.get(name, {})


@pytest.mark.parametrize("entry", [e for e in attnkit.mechanisms() if not e["layer_only"]], ids=lambda e: e["name"])
def test_mechanism_class_matches_attention_spec(entry):
    name = entry["name"]
    options = _mechanism_options(name)
    cls = getattr(ann.registry, _camel(name))
    a = cls(**options).eval()
    b = ann.Attention(name, **options).eval()
    spec = name + (":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
                   if options else "")
    c = ann.Attention(spec).eval()
    M = 3 if entry["supports"]["value_dim"] else 4
    q, k, v = torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, M)  # L = 7: odd (bp-tree), >= 2 (star)
    out = a(q, k, v)
    assert out.shape == (2, 2, 7, M) and torch.isfinite(out).all()
    assert torch.equal(out, b(q, k, v))
    assert torch.equal(out, c(q, k, v))
    pickle_copy = pickle.loads(pickle.dumps(a))
    assert type(pickle_copy) is cls and torch.equal(pickle_copy(q, k, v), out)


def _gated_linear_closed_form(q, k, v):
    f = torch.sigmoid(k) * v
    return ops.linear_attention(q, f, f)


@pytest.mark.parametrize("name, closed_form", [
    ("full", lambda q, k, v: ops.softmax_attention(q, k, v)),
    ("linear", lambda q, k, v: ops.linear_attention(q, k, v, feature_map="elu", normalize=True)),
    ("causal-linear", lambda q, k, v: ops.linear_attention(q, k, v, feature_map="elu", normalize=True, causal=True)),
    ("gated-linear", _gated_linear_closed_form),
    ("clustered", lambda q, k, v: ops.clustered_attention(q, k, v, clusters=3, seed=2)),
    ("improved-clustered", lambda q, k, v: ops.clustered_attention(q, k, v, clusters=2, topk=3, seed=1)),
    ("sparse-full", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("full", 7))),
    ("sparse-causal", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("causal", 7))),
    ("sparse-local", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("local", 7, 2))),
    ("sparse-local-causal", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("local-causal", 7, 2))),
    ("sparse-segments", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("segments", 7, 3))),
    ("sparse-segments-causal", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("segments-causal", 7, 3))),
    ("sparse-strided", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("strided", 7, 2))),
    ("sparse-random", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("random", 7, 2))),
    ("sparse-bp-tree", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("bp-tree", 4))),
    ("sparse-star", lambda q, k, v: ops.sparse_attention(q, k, v, *ops.edge_pattern("star", 6))),
])
def test_mechanism_module_equals_its_op(name, closed_form):
    """In eval mode (a clustered module uses its base seed) each mechanism is
    its op (docs/API.md's registry table), in float32 (the kernels) and float64."""
    options = {"linear": {}}.get(name, _mechanism_options(name))
    m = ann.Attention(name, **options).eval()
    for dtype in (torch.float32, f64):
        q, k, v = (torch.randn(2, 2, 7, 4, dtype=dtype) for _ in range(3))
        got, want = m(q, k, v), closed_form(q, k, v)
        assert got.dtype == dtype
        # The module calls the same op on the same tensors: bitwise equal.
        assert torch.equal(got, want), rel_err(got, want)


def test_clustered_module_advances_its_seed_in_training_only():
    m = ann.registry.Clustered(clusters=2, bits=4, seed=5)
    q, k, v = torch.randn(1, 4, 16, 4), torch.randn(1, 4, 16, 4), torch.randn(1, 4, 16, 3)
    seeds = [ops.clustered_attention(q, k, v, clusters=2, bits=4, seed=s) for s in range(5, 9)]
    assert any(not torch.equal(seeds[0], s) for s in seeds[1:]), "the seeds give the same labels: pick other data"
    outs = [m(q, k, v) for _ in range(4)]  # training mode: seed, seed + 1, ...
    for o, s in zip(outs, seeds):
        assert torch.equal(o, s)
    m.eval()
    assert torch.equal(m(q, k, v), seeds[0]) and torch.equal(m(q, k, v), seeds[0])


# ---------------------------------------------------------------------------------------
# MultiheadAttention's torch conventions and closed form
# ---------------------------------------------------------------------------------------

def _mha_closed_form(m, query, key, value, key_lengths=None, causal=False, mechanism=None):
    """out_proj(concat_h attention(q_proj(query)_h, k_proj(key)_h, v_proj(value)_h)) with
    attnkit.linear and the functional op, batch-first."""
    N, L, D = query.shape
    S, H = key.shape[1], m.num_heads
    p = dict(m.named_parameters())
    lin = lambda x, name: attnkit.linear(x, p[name + ".weight"], p.get(name + ".bias"))  # noqa: E731
    heads = lambda x, n: x.view(N, n, H, D // H).transpose(1, 2)  # noqa: E731
    q, k, v = heads(lin(query, "q_proj"), L), heads(lin(key, "k_proj"), S), heads(lin(value, "v_proj"), S)
    if mechanism is None:
        out = attnkit.softmax_attention(q, k, v, causal=causal, key_lengths=key_lengths)
    else:
        out = mechanism(q, k, v)
    return lin(out.transpose(1, 2).reshape(N, L, D), "out_proj")


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("causal, key_lengths", [(False, None), (True, None), (False, (7, 0)), (True, (3, 7))])
def test_multihead_full_equals_projections_and_softmax_attention(dtype, causal, key_lengths):
    m = ann.MultiheadAttention(12, 3, batch_first=True).to(dtype)
    q, kv = torch.randn(2, 5, 12, dtype=dtype), torch.randn(2, 7, 12, dtype=dtype)
    kl = None if key_lengths is None else lengths(*key_lengths)
    got = m(q, kv, kv, key_lengths=kl, is_causal=causal)[0]
    want = _mha_closed_form(m, q, kv, kv, key_lengths=kl, causal=causal)
    # The module runs the same ops on the same tensors (strided head views):
    # equal up to the kernels' choice of summation order for other strides.
    assert rel_err(got, want) <= (F32_TOL if dtype == torch.float32 else F64_TOL)
    if key_lengths is not None and key_lengths[1] == 0:
        # no visible key: attention gives 0, the output is out_proj's bias
        torch.testing.assert_close(got[1], m.out_proj.bias.detach().expand(5, 12), rtol=0, atol=0)


def test_multihead_linear_equals_linear_attention():
    m = ann.MultiheadAttention(8, 2, attention="causal-linear", batch_first=True).double()
    x = torch.randn(2, 6, 8, dtype=f64)
    want = _mha_closed_form(m, x, x, x, mechanism=lambda q, k, v: ops.linear_attention(
        q, k, v, feature_map="elu", normalize=True, causal=True))
    assert rel_err(m(x, x, x)[0], want) <= F64_TOL


def test_multihead_batch_first_false_vs_true():
    a = ann.MultiheadAttention(8, 2, batch_first=True)
    b = ann.MultiheadAttention(8, 2)  # (L, N, E)
    b.load_state_dict(a.state_dict())
    q, kv = torch.randn(3, 4, 8), torch.randn(3, 6, 8)
    pad = padding([6, 2, 5], 6)
    out_a = a(q, kv, kv, key_padding_mask=pad)[0]
    out_b, weights = b(q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), key_padding_mask=pad)
    assert weights is None
    assert out_b.shape == (4, 3, 8)
    assert torch.equal(out_b.transpose(0, 1), out_a)


def test_multihead_key_padding_mask_equals_key_lengths():
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 5, 8)
    lens = [5, 3, 0]
    by_lengths = m(x, x, x, key_lengths=lengths(*lens))[0]
    bool_mask = padding(lens, 5)
    float_mask = torch.zeros(3, 5).masked_fill(bool_mask, float("-inf"))
    assert torch.equal(m(x, x, x, key_padding_mask=bool_mask)[0], by_lengths)
    assert torch.equal(m(x, x, x, key_padding_mask=float_mask)[0], by_lengths)
    assert not torch.equal(by_lengths, m(x, x, x)[0])
    assert torch.equal(m(x, x, x, key_padding_mask=padding([5, 5, 5], 5))[0], m(x, x, x)[0])


def test_multihead_causal_mask_equals_is_causal():
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 6, 8)
    causal = m(q, kv, kv, is_causal=True)[0]
    hidden = torch.ones(4, 6, dtype=torch.bool).triu(6 - 4 + 1)  # bottom-right aligned
    assert torch.equal(m(q, kv, kv, attn_mask=hidden)[0], causal)
    assert torch.equal(m(q, kv, kv, attn_mask=torch.zeros(4, 6).masked_fill(hidden, float("-inf")))[0], causal)
    assert not torch.equal(m(q, kv, kv)[0], causal)
    # torch.nn.MultiheadAttention's mask convention: True = not allowed; the same causal output
    torch_mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    m4 = m(q, q, q, attn_mask=torch_mask)[0]
    assert torch.equal(m4, m(q, q, q, is_causal=True)[0])


def test_multihead_full_matches_torch_multihead_attention():
    """Same weights in torch.nn.MultiheadAttention (in_proj = [q; k; v]): same outputs."""
    m = ann.MultiheadAttention(8, 2, batch_first=True).double()
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True).double()
    p = dict(m.named_parameters())
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.cat([p[f"{n}_proj.weight"] for n in "qkv"]))
        t.in_proj_bias.copy_(torch.cat([p[f"{n}_proj.bias"] for n in "qkv"]))
        t.out_proj.weight.copy_(p["out_proj.weight"])
        t.out_proj.bias.copy_(p["out_proj.bias"])
    q, kv = torch.randn(2, 4, 8, dtype=f64), torch.randn(2, 6, 8, dtype=f64)
    pad = padding([6, 3], 6)
    want = t(q, kv, kv, key_padding_mask=pad, need_weights=False)[0]
    assert rel_err(m(q, kv, kv, key_padding_mask=pad)[0], want) <= F64_TOL
    # need_weights: the weights torch returns, averaged over the heads or per head, and
    # differentiable; the output does not change when they are asked for.
    for average in (True, False):
        out, weights = m(q, kv, kv, key_padding_mask=pad, need_weights=True, average_attn_weights=average)
        t_out, t_weights = t(q, kv, kv, key_padding_mask=pad, need_weights=True, average_attn_weights=average)
        assert torch.equal(out, m(q, kv, kv, key_padding_mask=pad)[0])
        assert weights.shape == t_weights.shape == ((2, 4, 6) if average else (2, 2, 4, 6))
        assert rel_err(weights, t_weights) <= F64_TOL
    assert m(q, kv, kv)[1] is None  # not asked: not formed
    weights = m(q, kv, kv, need_weights=True)[1]
    weights[:, :, 0].sum().backward()
    assert m.q_proj.weight.grad is not None and torch.isfinite(m.q_proj.weight.grad).all()
    # float32, causal (bottom-right, as the output's mask), sequence-first input
    m32 = ann.MultiheadAttention(8, 2)
    x = torch.randn(5, 2, 8)
    w = m32(x, x, x, need_weights=True, is_causal=True)[1]
    assert w.shape == (2, 5, 5) and torch.equal(w.triu(1), torch.zeros_like(w))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 5))


def test_multihead_grouped_heads_match_torch_with_repeated_projections():
    """kv_heads=2 of 4: torch.nn.MultiheadAttention whose k and v projections
    are each key/value head's rows repeated over its group gives the same
    output and weights; for full attention (read in place), and for linear
    attention (read in place) and a mechanism the module repeats heads for,
    each compared with itself at full heads."""
    H, Hk, D = 4, 2, 8
    dh = D // H
    m = ann.MultiheadAttention(D, H, batch_first=True, kv_heads=Hk).double()
    p = dict(m.named_parameters())
    assert p["k_proj.weight"].shape == (Hk * dh, D) and p["v_proj.bias"].shape == (Hk * dh,)

    def repeated(t):  # (Hk dh, ...) -> (H dh, ...): head g's rows for each of its H / Hk query heads
        return t.reshape(Hk, dh, *t.shape[1:]).repeat_interleave(H // Hk, 0).reshape(H * dh, *t.shape[1:])

    t = torch.nn.MultiheadAttention(D, H, batch_first=True).double()
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.cat([p["q_proj.weight"], repeated(p["k_proj.weight"]),
                                          repeated(p["v_proj.weight"])]))
        t.in_proj_bias.copy_(torch.cat([p["q_proj.bias"], repeated(p["k_proj.bias"]), repeated(p["v_proj.bias"])]))
        t.out_proj.weight.copy_(p["out_proj.weight"])
        t.out_proj.bias.copy_(p["out_proj.bias"])
    q, kv = torch.randn(2, 4, D, dtype=f64), torch.randn(2, 6, D, dtype=f64)
    pad = padding([6, 3], 6)
    out, weights = m(q, kv, kv, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    t_out, t_weights = t(q, kv, kv, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    assert rel_err(out, t_out) <= F64_TOL and rel_err(weights, t_weights) <= F64_TOL
    # Linear attention, the sparse patterns and clustered attention read the
    # groups in place, "none" gets them repeated by the module: either way the
    # output is that of full heads with the repeated projections.
    for spec in ("linear", "causal-linear", "sparse-local:span=2", "improved-clustered:clusters=2,topk=3", "none"):
        g = ann.MultiheadAttention(D, H, attention=spec, batch_first=True, kv_heads=Hk).double()
        f = ann.MultiheadAttention(D, H, attention=spec, batch_first=True).double()
        gp = dict(g.named_parameters())
        with torch.no_grad():
            for name, param in f.named_parameters():
                grouped = gp[name]
                param.copy_(repeated(grouped) if name.split(".")[0] in ("k_proj", "v_proj") else grouped)
        x = torch.randn(2, 5, D, dtype=f64)
        assert rel_err(g(x, x, x)[0], f(x, x, x)[0]) <= F64_TOL, spec
    grouped = {e["name"]: e["supports"]["grouped_heads"] for e in attnkit.mechanisms()}
    assert grouped["full"] and grouped["linear"] and grouped["causal-linear"] and grouped["clustered"]
    assert not grouped["none"]
    with pytest.raises(RuntimeError, match=r"kv_heads \(3\) must divide heads \(4\)"):
        ann.MultiheadAttention(D, H, kv_heads=3)


def test_transformer_takes_kv_heads():
    """The option reaches the C++ builder (decoding against the forward is
    tested there: tests/models/grouped_heads_test.cpp)."""
    model = Transformer(11, layers=2, width=16, heads=4, kv_heads=2, ffn=24, dropout=0.0)
    assert model.options["kv_heads"] == 2
    names = dict(model.named_parameters())
    assert names["decoder_0.self_attention.k_proj.weight"].shape == (8, 16)
    assert "kv_heads" not in Transformer(11, width=16, heads=4).options  # unset: written as before
    with pytest.raises(RuntimeError, match=r"kv_heads \(3\) must divide heads \(4\)"):
        Transformer(11, width=16, heads=4, kv_heads=3)


# ---------------------------------------------------------------------------------------
# Closed forms of the other modules
# ---------------------------------------------------------------------------------------

def test_linear_equals_torch_linear():
    m = ann.Linear(7, 4)
    x = torch.randn(3, 5, 7)
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert rel_err(m(x), F.linear(x.double(), m.weight.double(), m.bias.double())) <= F32_TOL
    m64 = copy.deepcopy(m).double()
    x64 = x.double().requires_grad_()
    y = m64(x64)
    assert rel_err(y, F.linear(x64, m64.weight, m64.bias)) <= F64_TOL
    # interchangeable state_dicts with torch.nn.Linear, both ways
    t = torch.nn.Linear(7, 4)
    t.load_state_dict(m.state_dict())
    assert rel_err(m(x), t(x)) <= F32_TOL
    nobias = ann.Linear(7, 4, bias=False)
    assert [n for n, _ in nobias.named_parameters()] == ["weight"]
    assert rel_err(nobias(x), F.linear(x, nobias.weight)) <= F32_TOL
    # torch.nn.Linear's initialisation: U(-1/sqrt(in), 1/sqrt(in))
    big = ann.Linear(100, 300)
    bound = 1 / math.sqrt(100)
    assert big.weight.abs().max() <= bound and big.weight.abs().max() > 0.9 * bound
    assert abs(big.weight.mean().item()) < 0.1 * bound


def _masked_softmax(e, key_lengths):
    if key_lengths is not None:
        hidden = torch.arange(e.shape[-1]).view(1, 1, -1) >= key_lengths.view(-1, 1, 1)
        e = e.masked_fill(hidden, float("-inf"))
    w = torch.softmax(e, -1)
    return torch.nan_to_num(w, nan=0.0)  # a row with no key: zero weights


@pytest.mark.parametrize("kind", ["additive", "general", "dot", "dot-unscaled", "location"])
def test_zoo_modules_equal_their_closed_form(kind):
    N, L, S, Dq, Dk, Dv = 2, 3, 5, 4, 3, 6
    kl = lengths(5, 0)
    s, h, values = torch.randn(N, L, Dq, dtype=f64), torch.randn(N, S, Dk, dtype=f64), torch.randn(N, S, Dv, dtype=f64)
    if kind == "additive":
        m = ann.AdditiveAttention(Dq, Dk, 7).double()
        p = dict(m.named_parameters())
        e = torch.tanh(F.linear(s, p["W.weight"], p["W.bias"]).unsqueeze(2) + F.linear(h, p["U.weight"]).unsqueeze(1)) @ p["v"]
        out = m(s, h, values, key_lengths=kl)
    elif kind == "general":
        m = ann.GeneralAttention(Dq, Dk).double()
        e = s @ m.W @ h.transpose(1, 2)
        out = m(s, h, values, key_lengths=kl)
    elif kind.startswith("dot"):
        m = ann.DotAttention(scaled=kind == "dot").double()
        h = torch.randn(N, S, Dq, dtype=f64)
        e = s @ h.transpose(1, 2) / (math.sqrt(Dq) if kind == "dot" else 1.0)
        out = m(s, h, values, key_lengths=kl)
    else:
        m = ann.LocationAttention(Dq, 8).double()
        e = F.linear(s, m.W.weight, m.W.bias)[..., :S]
        out = m(s, values, key_lengths=kl)
    weights = _masked_softmax(e, kl)
    context, w = out
    assert w.shape == (N, L, S) and context.shape == (N, L, Dv)
    assert rel_err(w, weights) <= F64_TOL
    assert rel_err(context, weights @ values) <= F64_TOL
    assert torch.equal(context[1], torch.zeros(L, Dv, dtype=f64)) and torch.equal(w[1], torch.zeros(L, S, dtype=f64))


def test_sinusoidal_positional_encoding_closed_form():
    d, offset = 7, 3
    m = ann.SinusoidalPositionalEncoding(d, max_length=20)
    assert list(dict(m.named_parameters())) == [] and list(dict(m.named_buffers())) == ["table"]
    x = torch.randn(2, 5, d, dtype=f64)
    pos = torch.arange(offset, offset + 5, dtype=f64).unsqueeze(1)
    i = torch.arange(d, dtype=f64)
    angle = pos / torch.pow(10000.0, (2 * torch.div(i, 2, rounding_mode="floor")) / d)
    table = torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle))  # odd d ends with a sin column
    out = m(x, offset=offset)
    assert out.dtype == f64
    # The table is float32 (computed in float64, then rounded): 2^-24 relative of values <= 1.
    assert (out - (x + table)).abs().max() <= 2 ** -24


def test_relative_position_attention_closed_form():
    D, H, K = 8, 2, 2
    m = ann.RelativePositionAttention(D, H, max_relative=K).double()
    p = dict(m.named_parameters())
    N, L = 2, 6
    x = torch.randn(N, L, D, dtype=f64)
    kl = lengths(6, 4)
    dz = D // H
    lin = lambda t, n: F.linear(t, p[n + ".weight"], p[n + ".bias"])  # noqa: E731
    heads = lambda t: t.view(N, L, H, dz).transpose(1, 2)  # noqa: E731
    q, k, v = heads(lin(x, "q_proj")), heads(lin(x, "k_proj")), heads(lin(x, "v_proj"))
    idx = torch.arange(L)
    bucket = (idx.view(1, -1) - idx.view(-1, 1)).clamp(-K, K) + K          # b_ij
    wK, wV = p["wK"][bucket], p["wV"][bucket]                              # (L, L, dz)
    e = (q.unsqueeze(3) * (k.unsqueeze(2) + wK)).sum(-1) / math.sqrt(dz)   # (N, H, L, L)
    hidden = (idx.view(1, 1, -1) > idx.view(1, -1, 1)) | (idx.view(1, 1, -1) >= kl.view(-1, 1, 1))  # (N, L, L)
    hidden = hidden.unsqueeze(1)
    alpha = torch.softmax(e.masked_fill(hidden, float("-inf")), -1)
    z = alpha @ v + (alpha.unsqueeze(-1) * wV).sum(-2)
    want = lin(z.transpose(1, 2).reshape(N, L, D), "out_proj")
    assert rel_err(m(x, key_lengths=kl, causal=True), want) <= F64_TOL


@pytest.mark.parametrize("causal", [False, True])
def test_agglomerative_layer_closed_form(causal):
    D, C = 6, 3
    m = ann.AgglomerativeAttention(D, C).double().eval()
    p = dict(m.named_parameters())
    N, L, S = 2, 4, 5
    x, ref = torch.randn(N, L, D, dtype=f64), torch.randn(N, S, D, dtype=f64)
    cq = torch.softmax(x @ p["W_q"] + p["b_q"], -1).transpose(1, 2)       # (N, C, L)
    cr = torch.softmax(ref @ p["W_r"] + p["b_r"], -1).transpose(1, 2)     # (N, C, S)
    v = (ref @ p["P"]).view(N, S, C, D // C).transpose(1, 2)              # class blocks (N, C, S, D/C)
    a = ops.agglomerative_attention(cq, cr, v, causal=causal)             # (N, C, L, D/C)
    want = a.transpose(1, 2).reshape(N, L, D) @ p["Q"]
    assert rel_err(m(x, ref, causal=causal), want) <= F64_TOL
    # self-attention: reference None is the query sequence
    assert torch.equal(m(x, causal=causal), m(x, x, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_gated_linear_attention_closed_form(causal):
    m = ann.GatedLinearAttention(4).double()
    p = dict(m.named_parameters())
    h = torch.randn(2, 5, 4, dtype=f64)
    f = torch.sigmoid(F.linear(h, p["gate.weight"], p["gate.bias"])) * h
    assert rel_err(m.features(h), f) <= F64_TOL
    if causal:
        q = torch.randn(2, 5, 4, dtype=f64)
        C = torch.cumsum(f.unsqueeze(-1) * f.unsqueeze(-2), 1)           # C_t = sum_{s<=t} f_s f_s^T
        want = (C @ q.unsqueeze(-1)).squeeze(-1)
    else:
        q = torch.randn(2, 3, 4, dtype=f64)                               # m != n queries
        want = q @ (f.transpose(1, 2) @ f)
    assert rel_err(m(h, q, causal=causal), want) <= F64_TOL


@pytest.mark.parametrize("feature_map, normalize, causal", [("identity", False, False), ("elu", True, True)])
def test_linear_attention_module_equals_the_op(feature_map, normalize, causal):
    m = ann.LinearAttention(feature_map, normalize=normalize, causal=causal, eps=1e-4)
    q, k, v = torch.randn(1, 2, 5, 3), torch.randn(1, 2, 6, 3), torch.randn(1, 2, 6, 2)
    assert torch.equal(m(q, k, v), ops.linear_attention(q, k, v, feature_map=feature_map, normalize=normalize,
                                                        causal=causal, eps=1e-4))


# ---------------------------------------------------------------------------------------
# DocumentMemory
# ---------------------------------------------------------------------------------------

# C = H^T H and C q in float32 against float64 from the same float32 values:
# sums of n = 40 (C) and dim = 6 (lookup) products, worst case ~(n + dim) u =
# 3e-6 relative; 1e-5.
MEMORY_TOL = 1e-5


def test_document_memory_append_lookup_merge():
    dim = 6
    h = torch.randn(40, dim)
    mem = ann.DocumentMemory(dim)
    assert mem.dim == dim and mem.num_states == 0
    assert torch.equal(mem.lookup(torch.randn(3, dim)), torch.zeros(3, dim))
    for chunk in h.split(7):
        assert mem.append(chunk) is mem
    assert mem.num_states == 40
    C = h.double().T @ h.double()
    assert mem.matrix().dtype == torch.float32 and rel_err(mem.matrix(), C) <= MEMORY_TOL
    q = torch.randn(9, dim)
    assert rel_err(mem.lookup(q), q.double() @ C) <= MEMORY_TOL
    # matrix() is a copy
    mem.matrix().zero_()
    assert mem.matrix().abs().max() > 0
    # merge: C adds, the states count
    other = ann.DocumentMemory(dim).append(h[:10])
    mem.merge(other)
    assert mem.num_states == 50 and other.num_states == 10
    assert rel_err(mem.matrix(), C + h[:10].double().T @ h[:10].double()) <= MEMORY_TOL
    assert repr(mem) == "DocumentMemory(dim=6, num_states=50)"


def test_document_memory_equals_gated_layer_lookup():
    """The cheap-linear-attention paper: storing the gated layer's features and
    looking up queries is the non-causal layer's output."""
    layer = ann.GatedLinearAttention(5)
    h, q = torch.randn(1, 30, 5), torch.randn(1, 4, 5)
    mem = ann.DocumentMemory(5).append(layer.features(h)[0].detach())
    assert rel_err(mem.lookup(q[0]), layer(h, q)[0].detach().double()) <= MEMORY_TOL


def test_document_memory_save_load(tmp_path):
    mem = ann.DocumentMemory(4).append(torch.randn(11, 4))
    path = tmp_path / "doc.mem"
    mem.save(path)
    loaded = ann.DocumentMemory.load(path)
    assert loaded.dim == 4 and loaded.num_states == 11
    assert torch.equal(loaded.matrix(), mem.matrix())
    q = torch.randn(3, 4)
    assert torch.equal(loaded.lookup(q), mem.lookup(q))
    mem.save(str(path))  # str paths too; overwrites atomically
    assert torch.equal(ann.DocumentMemory.load(str(path)).matrix(), mem.matrix())


@pytest.mark.parametrize("damage", ["flip a matrix byte", "flip a checksum byte", "truncate", "append a byte", "empty"])
def test_document_memory_refuses_a_corrupted_file(tmp_path, damage):
    mem = ann.DocumentMemory(4).append(torch.randn(11, 4))
    path = tmp_path / "doc.mem"
    mem.save(path)
    data = bytearray(path.read_bytes())
    if damage == "flip a matrix byte":
        data[len(data) - 8 - 5] ^= 0x10   # inside the float32 matrix, before the 8-byte checksum
    elif damage == "flip a checksum byte":
        data[-1] ^= 0x01
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "append a byte":
        data += b"\0"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with raises(RuntimeError, "DocumentMemory::load", str(path)):
        ann.DocumentMemory.load(path)


# ---------------------------------------------------------------------------------------
# Names before the naming pass: pickles, arguments and attnkit.nn.mechanisms still work
# ---------------------------------------------------------------------------------------

OLD_PICKLE = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "modules-before-rename.pt"


def test_modules_pickled_before_the_rename_load_and_compute_the_same():
    """tests/data/modules-before-rename.pt: modules whose pickled settings say
    embed_dim, num_heads and d_model (tests/data/README.md)."""
    saved = torch.load(OLD_PICKLE, weights_only=False)
    x = saved["input"]
    modules = saved["modules"]
    with torch.no_grad():
        got = {"relative": modules["relative"](x), "sinusoidal": modules["sinusoidal"](x),
               "agglomerative": modules["agglomerative"](x), "multihead": modules["multihead"](x, x, x)[0]}
    # The outputs were recorded on one CPU at one ISA level; another level's
    # float32 kernels (and oneDNN's GEMM) sum in another order, so they agree
    # to float32 rounding, not bitwise. Settings misread would change them
    # entirely.
    for name, want in saved["outputs"].items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # They now speak the current names, and pickle again under them.
    assert json.loads(modules["relative"].extra_repr()) == {"width": 8, "heads": 2, "max_relative": 3}
    assert json.loads(modules["sinusoidal"].extra_repr()) == {"width": 8, "max_length": 16}
    assert json.loads(modules["agglomerative"].extra_repr())["width"] == 8
    mha = json.loads(modules["multihead"].extra_repr())
    assert (mha["width"], mha["heads"]) == (8, 2) and "embed_dim" not in mha
    again = pickle.loads(pickle.dumps(modules["relative"]))
    with torch.no_grad():
        assert torch.equal(again(x), got["relative"])


def test_old_argument_names_still_work_with_a_deprecation_warning():
    torch.manual_seed(0)
    new = ann.RelativePositionAttention(8, 2, max_relative=3)
    with pytest.warns(DeprecationWarning, match="'embed_dim' is deprecated, use 'width'"):
        old = ann.RelativePositionAttention(embed_dim=8, num_heads=2, max_relative=3)
    assert old.extra_repr() == new.extra_repr()
    with pytest.warns(DeprecationWarning, match="'d_model' is deprecated, use 'width'"):
        assert ann.SinusoidalPositionalEncoding(d_model=8).extra_repr() == ann.SinusoidalPositionalEncoding(8).extra_repr()
    with pytest.warns(DeprecationWarning, match="'embed_dim' is deprecated"):
        assert ann.AgglomerativeAttention(embed_dim=8, classes=2).extra_repr() == \
            ann.AgglomerativeAttention(width=8, classes=2).extra_repr()
    with pytest.raises(TypeError, match="give 'width' or its old name 'embed_dim', not both"):
        ann.RelativePositionAttention(8, 2, embed_dim=8)
    with pytest.raises(TypeError, match="missing required argument 'heads'"):
        ann.RelativePositionAttention(8)
    # MultiheadAttention keeps torch.nn.MultiheadAttention's names.
    m = ann.MultiheadAttention(embed_dim=8, num_heads=2)
    assert (m.embed_dim, m.num_heads) == (8, 2)


def test_nn_mechanisms_is_the_registry_module_under_its_old_name():
    with pytest.warns(DeprecationWarning, match="attnkit.nn.registry"):
        old = ann.mechanisms
    assert old is ann.registry
    assert ann.registry.Clustered.__module__ == "attnkit.nn.registry"
    # Pickles of the classes written before the rename name the old module.
    assert __import__("sys").modules["attnkit.nn.mechanisms"] is ann.registry
    m = ann.registry.SparseLocal(span=2)
    text = pickle.dumps(m, protocol=0).replace(b"attnkit.nn.registry", b"attnkit.nn.mechanisms")
    assert b"attnkit.nn.mechanisms" in text
    back = pickle.loads(text)
    assert type(back) is ann.registry.SparseLocal and back.spec == "sparse-local:span=2"


def test_multihead_rotary_positions():
    """rotary_dim=4 of 8 features per head: the module's output (float64) is
    the projections with q and k rotated by attnkit.rotary_embedding (query i
    at i + S - L), for exact attention (rotated inside its kernel) and a sparse
    pattern (rotated before the call); its weights see the rotation too."""
    D, H, L, S = 16, 2, 5, 7
    q, kv = torch.randn(2, L, D, dtype=f64), torch.randn(2, S, D, dtype=f64)
    for spec in ("full", "sparse-local:span=2"):
        kv_ = kv if spec == "full" else q  # the sparse patterns are self-attention: L == S
        m = ann.MultiheadAttention(D, H, attention=spec, batch_first=True, rotary_dim=4, rotary_base=500.0).double()
        p = dict(m.named_parameters())

        def heads(x, w, b):
            return torch.ops.attnkit.linear(x, w, b).view(2, x.shape[1], H, D // H).transpose(1, 2)

        qh = attnkit.rotary_embedding(heads(q, p["q_proj.weight"], p["q_proj.bias"]), 4, base=500.0,
                                      offset=kv_.shape[1] - L)
        kh = attnkit.rotary_embedding(heads(kv_, p["k_proj.weight"], p["k_proj.bias"]), 4, base=500.0)
        vh = heads(kv_, p["v_proj.weight"], p["v_proj.bias"])
        attended = ann.Attention(spec)(qh, kh, vh)
        want = torch.ops.attnkit.linear(attended.transpose(1, 2).reshape(2, L, D), p["out_proj.weight"],
                                        p["out_proj.bias"])
        out, weights = m(q, kv_, kv_, need_weights=(spec == "full"))
        assert rel_err(out, want) <= F64_TOL, spec
        if spec == "full":
            unrotated = torch.softmax(qh @ kh.transpose(-2, -1) / (D // H) ** 0.5, -1).mean(1)
            assert rel_err(weights, unrotated) <= F64_TOL
    supports = {e["name"]: e["supports"]["rotary"] for e in attnkit.mechanisms()}
    assert (supports["full"], supports["sparse-local"], supports["linear"], supports["causal-linear"],
            supports["gated-linear"]) == ("kernel", "inputs", "kernel", "kernel", "none")
    with pytest.raises(RuntimeError, match=r"rotary positions.*'gated-linear' has none"):
        ann.MultiheadAttention(D, H, attention="gated-linear", rotary_dim=4)


def test_transformer_takes_rope_positions():
    model = Transformer(11, layers=2, width=16, heads=2, ffn=24, dropout=0.0, positions="rope",
                        rotary_fraction=0.5)
    assert model.options["positions"] == "rope" and model.options["rotary_fraction"] == 0.5
    assert "rotary_fraction" not in Transformer(11, width=16, heads=2, positions="rope").options
    with pytest.raises(RuntimeError, match=r"choose one of relative, alibi and rope"):
        Transformer(11, width=16, heads=2, positions="alibi+rope")


def test_transformer_takes_the_llama_block():
    torch.manual_seed(0)
    model = Transformer(11, block="llama", layers=2, width=16, heads=4, kv_heads=2, ffn=24, dropout=0.0)
    options = model.options
    assert (options["normalization"], options["feed_forward"], options["bias"], options["positions"],
            options["norm"], options["kv_heads"]) == ("rms", "swiglu", False, "rope", "pre", 2)
    names = [name for name, _ in model.named_parameters()]
    assert not [name for name in names if name.endswith("bias")]
    assert "decoder_0.ff3.weight" in names
    # Given options win over the block's; the classic block writes none of its keys.
    assert Transformer(11, block="llama", width=16, heads=2, positions="conv+rope").options["positions"] == "conv+rope"
    assert not {"normalization", "feed_forward", "bias"} & set(Transformer(11, width=16, heads=2).options)
    # A gradient reaches every parameter (decoding: tests/models/modern_block_test.cpp).
    tokens = torch.randint(0, 11, (2, 9))
    model(tokens).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="block must be 'classic' or 'llama'"):
        Transformer(11, block="gpt")
