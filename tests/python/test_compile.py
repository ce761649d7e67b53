"""torch.compile and torch.export over attnkit's ops (torch 2 only; on torch
1.13 every test is skipped with the reason, which pytest's -rs prints).

What is compiled is a user's own module calling attnkit functions, the way
torch's own attention functions are called: it must compile with
fullgraph=True (no graph break), forward and backward, and match eager
within float32 rounding (the compiled graph calls the same kernels; what
inductor fuses around them, the projections and reshapes, may round
differently); torch.export must export it and the exported program must
survive a save/load round trip. The ops that take part have their kernels as
ops of their own with Meta kernels (src/ops/kernel_op.h): today
softmax_attention, the scaled_dot_product_attention over it, varlen_attention,
linear_attention, varlen_linear_attention, gated_linear_attention,
agglomerative_attention, clustered_attention (its clustering too),
sparse_attention, linear and rotary_embedding; the two tensor factories,
attention_dropout_mask and edge_pattern, have fake implementations.
test_compile_modules.py compiles attnkit.nn modules and models.Transformer.
"""
import io
import unittest

import torch

import attnkit
from conftest import rel_err

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2
SKIP = f"torch {torch.__version__} has no torch.compile / torch.export / torch.library.opcheck (torch 2)"

# Relative to the largest entry (conftest.rel_err): float32 rounding of a few
# reordered sums, far below any real difference (a wrong mask or scale gives
# errors of order 1e-1).
TOLERANCE = 1e-5


class UserAttention(torch.nn.Module):
    """Self-attention written with attnkit's functions: the input projection
    torch's own, the output projection attnkit.linear, causal attention with
    rotary positions and padded keys and torch 2's SDPA signature with a
    boolean mask, summed."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x, key_lengths, mask):
        N, L, D = x.shape
        q, k, v = self.qkv(x).view(N, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = attnkit.softmax_attention(q, k, v, causal=True, key_lengths=key_lengths, rotary_dim=4)
        b = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attnkit.linear((a + b).transpose(1, 2).reshape(N, L, D), self.out.weight, self.out.bias)


def user_inputs(N=2, L=13, D=32):
    x = torch.randn(N, L, D, requires_grad=True)
    key_lengths = torch.tensor([L, L - 5])
    mask = torch.rand(L, L) > 0.3
    mask.fill_diagonal_(True)  # every row sees a key
    return x, key_lengths, mask


def values_and_grads(module, fn, inputs):
    """fn(*inputs)'s output, and the gradients of a fixed random projection
    of it towards the input and every parameter."""
    module.zero_grad()
    x = inputs[0].detach().requires_grad_(True)
    out = fn(x, *inputs[1:])
    torch.manual_seed(1)
    (out * torch.randn_like(out)).sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


@unittest.skipUnless(TORCH_2, SKIP)
class CompileTest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        torch._dynamo.reset()

    def check_equal(self, actual, expected):
        self.assertEqual(len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected)):
            self.assertLess(rel_err(a, e), TOLERANCE, f"tensor {i} (0: output, 1: input grad, then parameters)")

    def test_user_module_compiles_without_graph_break(self):
        module = UserAttention()
        inputs = user_inputs()
        explanation = torch._dynamo.explain(module)(*inputs)
        self.assertEqual(explanation.graph_break_count, 0, explanation.break_reasons)
        self.assertEqual(explanation.graph_count, 1)

    def test_compiled_equals_eager_inductor(self):
        # torch.compile's default backend (inductor, which generates C++ for
        # the code around the attnkit ops), forward and backward.
        module = UserAttention()
        inputs = user_inputs()
        expected = values_and_grads(module, module, inputs)
        compiled = torch.compile(module, fullgraph=True)
        self.check_equal(values_and_grads(module, compiled, inputs), expected)

    def test_compiled_equals_eager_gqa_bias_and_awkward_shapes(self):
        # L != S, grouped-query heads, a broadcast float bias with a gradient,
        # a length-1 query; AOTAutograd's eager backend (the same graphs,
        # no code generation).
        def fn(q, k, v, bias):
            return attnkit.softmax_attention(q, k, v, bias=bias, alibi_slopes=attnkit.alibi_slopes(4))

        for L, S in [(1, 7), (9, 33), (17, 5)]:
            q = torch.randn(2, 4, L, 8, requires_grad=True)
            k = torch.randn(2, 2, S, 8, requires_grad=True)
            v = torch.randn(2, 2, S, 6, requires_grad=True)
            bias = torch.randn(1, 4, 1, S, requires_grad=True)
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            results = []
            for f in (fn, compiled):
                out = f(q, k, v, bias)
                torch.manual_seed(2)
                grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v, bias))
                results.append([out.detach(), *grads])
            self.check_equal(results[1], results[0])

    def test_varlen_attention_compiles(self):
        # A packed batch of three sequences (one empty), grouped-query heads,
        # causal with ALiBi; the offsets are inputs of the graph.
        def fn(q, k, v, cu_q, cu_k):
            return attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=attnkit.alibi_slopes(4))

        cu_q, cu_k = torch.tensor([0, 5, 5, 12]), torch.tensor([0, 7, 9, 17])
        q = torch.randn(12, 4, 8, requires_grad=True)
        k = torch.randn(17, 2, 8, requires_grad=True)
        v = torch.randn(17, 2, 6, requires_grad=True)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        results = []
        for f in (fn, compiled):
            out = f(q, k, v, cu_q, cu_k)
            torch.manual_seed(4)
            results.append([out.detach(), *torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v))])
        self.check_equal(results[1], results[0])
        # Other offsets, the same shapes: the graph reads them, not a copy made while tracing.
        other = torch.tensor([0, 2, 10, 12]), torch.tensor([0, 1, 16, 17])
        self.assertLess(rel_err(compiled(q, k, v, *other), fn(q, k, v, *other)), TOLERANCE)
        # float64 takes the composite, which cuts the batch by the offsets' values: refused.
        with self.assertRaisesRegex(Exception, "cannot be traced"):
            compiled(q.double(), k.double(), v.double(), cu_q, cu_k)

    def compiled_matches_eager(self, fn, inputs, leaves, seed=5):
        """fn compiled (aot_eager, fullgraph) against fn: values and the
        gradients of a random projection towards `leaves` (indices)."""
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        results = []
        for f in (fn, compiled):
            out = f(*inputs)
            torch.manual_seed(seed)
            grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), [inputs[i] for i in leaves])
            results.append([out.detach(), *grads])
        self.check_equal(results[1], results[0])

    def test_linear_attention_family_compiles(self):
        q = torch.randn(2, 4, 9, 8, requires_grad=True)
        k = torch.randn(2, 2, 9, 8, requires_grad=True)
        v = torch.randn(2, 2, 9, 6, requires_grad=True)
        for options in [dict(), dict(feature_map="elu", normalize=True, causal=True, rotary_dim=4)]:
            self.compiled_matches_eager(lambda q, k, v: attnkit.linear_attention(q, k, v, **options), (q, k, v),
                                        (0, 1, 2))
        cu_q, cu_k = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 2, 7, 9])
        packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]  # (T, H, E)
        self.compiled_matches_eager(
            lambda q, k, v: attnkit.varlen_linear_attention(q, k, v, cu_q, cu_k, feature_map="elu", normalize=True),
            packed, (0, 1, 2))
        f, g = torch.randn(2, 3, 11, 5, requires_grad=True), torch.randn(2, 3, 11, 5, requires_grad=True)
        alpha, beta = torch.rand(2, 3, 11, requires_grad=True), torch.rand(2, 3, 11, requires_grad=True)
        self.compiled_matches_eager(lambda f, g, a, b: attnkit.gated_linear_attention(f, g, a, b, causal=True),
                                    (f, g, alpha, beta), (0, 1, 2, 3))

    def test_agglomerative_attention_compiles(self):
        for causal in (False, True):
            cq = torch.softmax(torch.randn(2, 3, 9), 1).requires_grad_()
            cr = torch.softmax(torch.randn(2, 3, 9), 1).requires_grad_()
            v = torch.randn(2, 9, 3, 4).transpose(1, 2).requires_grad_()  # classes interleaved, as x P is
            self.compiled_matches_eager(lambda cq, cr, v: attnkit.agglomerative_attention(cq, cr, v, causal=causal),
                                        (cq, cr, v), (0, 1, 2))

    def test_clustered_attention_compiles(self):
        # Plain and improved clustered attention, padded keys and queries,
        # grouped-query heads: the clustering is an op of the graph too
        # (attnkit::_cluster_queries), so new inputs are clustered anew.
        q = torch.randn(2, 4, 21, 8, requires_grad=True)
        k = torch.randn(2, 2, 17, 8, requires_grad=True)
        v = torch.randn(2, 2, 17, 6, requires_grad=True)
        key_lengths, query_lengths = torch.tensor([17, 9]), torch.tensor([21, 14])
        for topk in (0, 5):
            def fn(q, k, v):
                return attnkit.clustered_attention(q, k, v, clusters=4, bits=31, topk=topk, seed=3,
                                                   key_lengths=key_lengths, query_lengths=query_lengths)

            self.compiled_matches_eager(fn, (q, k, v), (0, 1, 2))
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            other = torch.randn_like(q)
            self.assertTrue(torch.equal(compiled(other, k, v), fn(other, k, v)), f"topk = {topk}")

    def test_sparse_attention_compiles(self):
        # One list for all heads and one per head, ALiBi, grouped-query heads;
        # the edge list is an input of the graph: another list of the same
        # sizes gives that list's result.
        offsets, columns = attnkit.edge_pattern("local", 13, 3)
        q = torch.randn(2, 4, 13, 8, requires_grad=True)
        k = torch.randn(2, 2, 13, 8, requires_grad=True)
        v = torch.randn(2, 2, 13, 6, requires_grad=True)

        def fn(q, k, v, offsets, columns):
            return attnkit.sparse_attention(q, k, v, offsets, columns, alibi_slopes=attnkit.alibi_slopes(4))

        self.compiled_matches_eager(lambda q, k, v: fn(q, k, v, offsets, columns), (q, k, v), (0, 1, 2))
        per_head = offsets.expand(4, -1).contiguous()
        self.compiled_matches_eager(lambda q, k, v: fn(q, k, v, per_head, columns), (q, k, v), (0, 1, 2))
        # The same offsets, other columns (row i reads its first keys): the
        # graph reads the list it is given, not one copied while tracing.
        counts = (offsets[1:] - offsets[:-1]).tolist()
        other = torch.cat([torch.arange(c) for c in counts])
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        self.assertLess(rel_err(compiled(q, k, v, offsets, other), fn(q, k, v, offsets, other)), TOLERANCE)

    def test_tensor_factories_compile(self):
        # attention_dropout_mask and edge_pattern take no tensor: their fake
        # implementations (attnkit/_compile.py) shape them while tracing; the
        # compiled graph computes them.
        def fn(x):
            keep = attnkit.attention_dropout_mask(1, 2, 5, 7, 0.25, 11)
            offsets, columns = attnkit.edge_pattern("local", 7, 2)
            return x * keep + offsets.sum() + columns.sum()

        x = torch.randn(1, 2, 5, 7)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        self.assertTrue(torch.equal(compiled(x), fn(x)))
        explanation = torch._dynamo.explain(fn)(x)
        self.assertEqual(explanation.graph_break_count, 0, explanation.break_reasons)

    def test_rotary_embedding_compiles(self):
        def fn(x):
            return attnkit.rotary_embedding(x, 6, base=500.0, offset=3) * 2

        x = torch.randn(2, 3, 7, 10, requires_grad=True)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        results = []
        for f in (fn, compiled):
            out = f(x)
            torch.manual_seed(3)
            results.append([out.detach(), *torch.autograd.grad((out * torch.randn_like(out)).sum(), (x,))])
        self.check_equal(results[1], results[0])

    def test_a_new_shape_compiles_anew(self):
        # The checks read sizes as integers, which specialises the graph on
        # them (docs/API.md): a second length is a second graph, still right.
        def fn(q):
            return attnkit.softmax_attention(q, q, q, causal=True)

        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for L in (8, 9, 10):
            q = torch.randn(1, 2, L, 8)
            self.assertLess(rel_err(compiled(q), fn(q)), TOLERANCE, f"L = {L}")

    def test_dropout_needs_a_seed_under_compile(self):
        q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))

        def unseeded(q, k, v):
            return attnkit.softmax_attention(q, k, v, dropout_p=0.5)

        with self.assertRaisesRegex(Exception, "needs an explicit dropout_seed"):
            torch.compile(unseeded, fullgraph=True, backend="aot_eager")(q, k, v)

        def seeded(q, k, v):
            return attnkit.softmax_attention(q, k, v, dropout_p=0.5, dropout_seed=7)

        compiled = torch.compile(seeded, fullgraph=True, backend="aot_eager")
        self.assertTrue(torch.equal(compiled(q, k, v), seeded(q, k, v)))

    def test_validation_errors_are_the_eager_ones(self):
        q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8)
        message = "has head count 3, which must divide q's head count 4"
        with self.assertRaisesRegex(RuntimeError, message):
            attnkit.softmax_attention(q, k, v)
        with self.assertRaisesRegex(Exception, message):
            torch.compile(lambda q, k, v: attnkit.softmax_attention(q, k, v), fullgraph=True,
                          backend="aot_eager")(q, k, v)

    def test_export_round_trip(self):
        module = UserAttention()
        x, key_lengths, mask = user_inputs()
        x = x.detach()
        with torch.no_grad():
            expected = module(x, key_lengths, mask)
        program = torch.export.export(module, (x, key_lengths, mask))

        def targets(p):
            return {str(node.target) for node in p.graph.nodes if node.op == "call_function"}

        # torch.export's graph keeps the ops a user called; decomposed (as a
        # compiler would, e.g. for inference) the kernel ops remain.
        self.assertTrue({"attnkit.softmax_attention.default", "attnkit.scaled_dot_product_attention.default",
                         "attnkit.linear.default"} <= targets(program), targets(program))
        decomposed = program.run_decompositions()
        self.assertTrue({"attnkit._softmax_attention_forward.default", "attnkit._linear_forward.default"}
                        <= targets(decomposed), targets(decomposed))
        self.assertFalse({t for t in targets(decomposed) if t.startswith("attnkit.") and ".default" in t
                          and not t.startswith("attnkit._")})
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        buffer.seek(0)
        loaded = torch.export.load(buffer)
        for p in (program, decomposed, loaded):
            with torch.no_grad():
                self.assertLess(rel_err(p.module()(x, key_lengths, mask), expected), TOLERANCE)


@unittest.skipUnless(TORCH_2, SKIP)
class KernelOpsTest(unittest.TestCase):
    """The kernel ops themselves: their Meta kernels give what the CPU kernels
    give (shapes, strides, dtypes; torch.library.opcheck runs both), and
    they refuse what the kernels cannot take."""

    @staticmethod
    def forward_args(L=9, S=11, Hkv=2, bias=False, lengths=False):
        q = torch.randn(2, 4, L, 8)
        k, v = torch.randn(2, Hkv, S, 8), torch.randn(2, Hkv, S, 6)
        return (q, k, v, torch.randn(4, 1, S) if bias else None, torch.tensor([S, 3]) if lengths else None,
                None, 0.35, True, 0, 10000.0, 0, 0.0, 0)

    def test_opcheck(self):
        for shape in [dict(), dict(L=1, S=1), dict(Hkv=4, bias=True), dict(lengths=True)]:
            args = self.forward_args(**shape)
            torch.library.opcheck(torch.ops.attnkit._softmax_attention_forward, args,
                                  test_utils=("test_schema", "test_faketensor"))
            out, lse = torch.ops.attnkit._softmax_attention_forward(*args)
            q, k, v, bias = args[:4]
            backward_args = (torch.randn_like(out), q, k, v, out, lse) + args[3:] + (bias is not None,)
            torch.library.opcheck(torch.ops.attnkit._softmax_attention_backward, backward_args,
                                  test_utils=("test_schema", "test_faketensor"))
            dq, dk, dv, dbias, dsinks, dtables = torch.ops.attnkit._softmax_attention_backward(*backward_args)
            self.assertEqual((dq.shape, dk.shape, dv.shape), (q.shape, k.shape, v.shape))
            self.assertEqual(dbias.shape, bias.shape if bias is not None else (0,))
            self.assertEqual((dsinks.shape, dtables.shape), ((0,), (0,)))

    def test_opcheck_with_a_block_mask_sinks_and_the_lse_gradient(self):
        args = self.forward_args()
        q, k, v = args[:3]
        mask = attnkit.create_block_mask(attnkit.masks.sliding_window(9, 11, 4), None, None, 9, 11, BLOCK_SIZE=4)
        extra = dict(mask.as_arguments(), sinks=torch.randn(4))
        utils = ("test_schema", "test_faketensor")
        torch.library.opcheck(torch.ops.attnkit._softmax_attention_forward, args, extra, test_utils=utils)
        out, lse = torch.ops.attnkit._softmax_attention_forward(*args, **extra)
        backward_args = (torch.randn_like(out), q, k, v, out, lse) + args[3:] + (False,)
        backward_extra = dict(extra, grad_lse=torch.randn_like(lse))
        torch.library.opcheck(torch.ops.attnkit._softmax_attention_backward, backward_args, backward_extra,
                              test_utils=utils)
        dq, dk, dv, dbias, dsinks, _ = torch.ops.attnkit._softmax_attention_backward(*backward_args, **backward_extra)
        self.assertEqual((dq.shape, dsinks.shape), (q.shape, (4,)))

    def test_opcheck_with_a_score_mod(self):
        args = self.forward_args()
        q, k, v = args[:3]
        table = torch.randn(4, 8)
        program = attnkit.score_mods.trace(lambda s, b, h, i, j: s + table[h, (i - j).abs().clamp(max=7)])
        extra = dict(score_code=program.code, score_values=program.values, score_tables=program.flat_tables())
        utils = ("test_schema", "test_faketensor")
        torch.library.opcheck(torch.ops.attnkit._softmax_attention_forward, args, extra, test_utils=utils)
        out, lse = torch.ops.attnkit._softmax_attention_forward(*args, **extra)
        backward_args = (torch.randn_like(out), q, k, v, out, lse) + args[3:] + (False,)
        torch.library.opcheck(torch.ops.attnkit._softmax_attention_backward, backward_args, extra, test_utils=utils)
        dtables = torch.ops.attnkit._softmax_attention_backward(*backward_args, **extra)[5]
        self.assertEqual(dtables.shape, (32,))

    def test_opcheck_linear(self):
        for x_shape, transposed, bias in [((5, 7), False, True), ((2, 3, 7), True, False), ((1, 7), False, False)]:
            x = torch.randn(*x_shape)
            weight = torch.randn(7, 4).t() if transposed else torch.randn(4, 7)  # (out, in) = (4, 7)
            b = torch.randn(4) if bias else None
            torch.library.opcheck(torch.ops.attnkit._linear_forward, (x, weight, b),
                                  test_utils=("test_schema", "test_faketensor"))
            y = torch.ops.attnkit._linear_forward(x, weight, b)
            for asked in [(True, True, bias), (False, True, False), (True, False, False)]:
                torch.library.opcheck(torch.ops.attnkit._linear_backward, (torch.randn_like(y), x, weight, *asked),
                                      test_utils=("test_schema", "test_faketensor"))
            dx, dw, db = torch.ops.attnkit._linear_backward(torch.randn_like(y), x, weight, True, True, True)
            self.assertEqual((dx.shape, dw.shape, db.shape), (x.shape, weight.shape, (4,)))
            self.assertEqual(dw.stride(), weight.stride())  # the weight's stored layout

    def test_opcheck_rotary(self):
        for shape, inverse in [((2, 3, 7, 10), False), ((1, 1, 1, 4), True)]:
            torch.library.opcheck(torch.ops.attnkit._rotary_embedding, (torch.randn(*shape), 4, 10000.0, 2, inverse),
                                  test_utils=("test_schema", "test_faketensor"))
        strided = torch.randn(2, 7, 3, 10).transpose(1, 2)  # a view: y comes back contiguous
        torch.library.opcheck(torch.ops.attnkit._rotary_embedding, (strided, 10, 10000.0, 0, False),
                              test_utils=("test_schema", "test_faketensor"))

    def test_opcheck_varlen(self):
        cu_q, cu_k = torch.tensor([0, 3, 3, 9]), torch.tensor([0, 4, 6, 11])
        for Hkv in (4, 2):
            q, k, v = torch.randn(9, 4, 8), torch.randn(11, Hkv, 8), torch.randn(11, Hkv, 5)
            args = (q, k, v, cu_q, cu_k, None, 0.35, True, 0, 10000.0, 0, 0.0, 0)
            torch.library.opcheck(torch.ops.attnkit._varlen_attention_forward, args,
                                  test_utils=("test_schema", "test_faketensor"))
            out, lse = torch.ops.attnkit._varlen_attention_forward(*args)
            backward_args = (torch.randn_like(out), q, k, v, out, lse) + args[3:]
            torch.library.opcheck(torch.ops.attnkit._varlen_attention_backward, backward_args,
                                  test_utils=("test_schema", "test_faketensor"))
        with self.assertRaisesRegex(RuntimeError, "_varlen_attention_forward: argument 'cu_seqlens_k' must end at"):
            torch.ops.attnkit._varlen_attention_forward(q, k, v, cu_q, torch.tensor([0, 4, 6, 10]), *args[5:])

    def test_opcheck_linear_attention_family(self):
        utils = ("test_schema", "test_faketensor")
        q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 5)
        for normalize in (False, True):
            options = ("elu", normalize, True, 1e-6, 0, 10000.0)
            torch.library.opcheck(torch.ops.attnkit._linear_attention_forward, (q, k, v) + options, test_utils=utils)
            out, den = torch.ops.attnkit._linear_attention_forward(q, k, v, *options)
            self.assertEqual(den.shape, (2, 4, 7) if normalize else (0,))
            torch.library.opcheck(torch.ops.attnkit._linear_attention_backward,
                                  (torch.randn_like(out), q, k, v, out, den) + options, test_utils=utils)
            cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 5, 7])
            packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
            args = (*packed, cu_q, cu_k) + options
            torch.library.opcheck(torch.ops.attnkit._varlen_linear_attention_forward, args, test_utils=utils)
            out, den = torch.ops.attnkit._varlen_linear_attention_forward(*args)
            torch.library.opcheck(torch.ops.attnkit._varlen_linear_attention_backward,
                                  (torch.randn_like(out), *packed, out, den, cu_q, cu_k) + options, test_utils=utils)
        f, g, alpha, beta = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), torch.rand(2, 3, 6), torch.rand(2, 3, 6)
        torch.library.opcheck(torch.ops.attnkit._gated_linear_attention_forward, (f, g, alpha, beta, True),
                              test_utils=utils)
        for asked in [(True, True), (False, False)]:
            torch.library.opcheck(torch.ops.attnkit._gated_linear_attention_backward,
                                  (torch.randn_like(f), f, g, alpha, beta, True, *asked), test_utils=utils)

    def test_opcheck_agglomerative(self):
        utils = ("test_schema", "test_faketensor")
        cq, cr = torch.rand(2, 3, 7), torch.rand(2, 3, 5)
        for v in (torch.randn(2, 3, 5, 4), torch.randn(2, 5, 3, 4).transpose(1, 2)):
            for causal, save in [(False, True), (True, True), (True, False)]:
                torch.library.opcheck(torch.ops.attnkit._agglomerative_forward, (cq, cr, v, causal, 1e-6, save),
                                      test_utils=utils)
            for causal in (False, True):
                out, avg, den = torch.ops.attnkit._agglomerative_forward(cq, cr, v, causal, 1e-6, True)
                torch.library.opcheck(torch.ops.attnkit._agglomerative_backward,
                                      (torch.randn_like(out), cq, cr, v, avg, den, causal, 1e-6), test_utils=utils)

    def test_opcheck_clustered(self):
        utils = ("test_schema", "test_faketensor")
        q, k, v = torch.randn(2, 4, 11, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 5)
        for query_lengths in (None, torch.tensor([11, 6])):
            torch.library.opcheck(torch.ops.attnkit._cluster_queries, (q, query_lengths, 3, 31, 10, 5, True),
                                  test_utils=utils)
        labels = torch.ops.attnkit._cluster_queries(q, torch.tensor([11, 6]), 3, 31, 10, 5, True)
        for key_lengths, topk in [(None, 0), (torch.tensor([9, 4]), 3), (None, 9)]:
            args = (q, k, v, labels, key_lengths, 3, topk, 0.35)
            torch.library.opcheck(torch.ops.attnkit._clustered_attention_forward, args, test_utils=utils)
            out, *saved = torch.ops.attnkit._clustered_attention_forward(*args)
            torch.library.opcheck(torch.ops.attnkit._clustered_attention_backward,
                                  (torch.randn_like(out), q, k, v, labels, key_lengths, *saved, 3, topk, 0.35),
                                  test_utils=utils)

    def test_opcheck_sparse(self):
        utils = ("test_schema", "test_faketensor")
        offsets, columns = torch.ops.attnkit.edge_pattern("local", 7, 2)
        q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 5)
        for lists, slopes in [(offsets.unsqueeze(0), None), (offsets.expand(4, -1).contiguous(), torch.rand(4))]:
            args = (q, k, v, lists, columns, 0.35, slopes)
            torch.library.opcheck(torch.ops.attnkit._sparse_attention_forward, args, test_utils=utils)
            out, lse = torch.ops.attnkit._sparse_attention_forward(*args)
            torch.library.opcheck(torch.ops.attnkit._sparse_attention_backward,
                                  (torch.randn_like(out), q, k, v, out, lse, lists, columns, 0.35, slopes),
                                  test_utils=utils)
        torch.library.opcheck(torch.ops.attnkit.edge_pattern, ("bp-tree", 9, 0), test_utils=utils)
        torch.library.opcheck(torch.ops.attnkit.attention_dropout_mask, (2, 3, 4, 5, 0.3, 7), test_utils=utils)

    def test_kernel_ops_check_their_arguments(self):
        q, k, v, *rest = self.forward_args()
        with self.assertRaisesRegex(RuntimeError, "argument 'v' has key count S"):
            torch.ops.attnkit._softmax_attention_forward(q, k, v[:, :, 1:], *rest)
        with self.assertRaisesRegex(RuntimeError, "_softmax_attention_forward: the kernels take float32 or bfloat16"):
            torch.ops.attnkit._softmax_attention_forward(q.double(), k.double(), v.double(), *rest)
        out, lse = torch.ops.attnkit._softmax_attention_forward(q, k, v, *rest)
        with self.assertRaisesRegex(RuntimeError, "argument 'lse' must be contiguous float32"):
            torch.ops.attnkit._softmax_attention_backward(torch.randn_like(out), q, k, v, out, lse[:, :, 1:],
                                                          *rest, False)

    def test_every_kernel_op_refuses_bad_arguments(self):
        # Each kernel op is callable from Python on its own: it checks what
        # its kernel reads (shapes, dtypes, index values) with a clear error
        # rather than reading out of bounds.
        ops = torch.ops.attnkit
        x, w = torch.randn(5, 7), torch.randn(4, 6)
        with self.assertRaisesRegex(RuntimeError, "so x must end in in = 6"):
            ops._linear_forward(x, w, None)
        q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
        with self.assertRaisesRegex(RuntimeError, "_linear_attention_forward"):
            ops._linear_attention_forward(q, k, v[:, :, 1:], "elu", True, False, 1e-6, 0, 10000.0)
        f, g, alpha = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.rand(1, 2, 5)
        with self.assertRaisesRegex(RuntimeError, "_gated_linear_attention_forward"):
            ops._gated_linear_attention_forward(f, g, alpha, alpha[:, :, 1:], True)
        cq, cr = torch.rand(1, 2, 5), torch.rand(1, 2, 5)
        with self.assertRaisesRegex(RuntimeError, "_agglomerative_forward"):
            ops._agglomerative_forward(cq, cr, v, False, -1.0, True)
        with self.assertRaisesRegex(RuntimeError, "_rotary_embedding"):
            ops._rotary_embedding(q, 3, 10000.0, 0, False)
        with self.assertRaisesRegex(RuntimeError, "_cluster_queries: option 'clusters'"):
            ops._cluster_queries(q, None, 9, 31, 10, 0, True)
        labels = ops._cluster_queries(q, None, 2, 31, 10, 0, True)
        with self.assertRaisesRegex(RuntimeError, "argument 'labels' has an entry 2 outside"):
            ops._clustered_attention_forward(q, k, v, torch.full_like(labels, 2), None, 2, 0, 0.5)
        out, *saved = ops._clustered_attention_forward(q, k, v, labels, None, 2, 2, 0.5)
        saved[2] = torch.full_like(saved[2], 5)  # top keys beyond S
        with self.assertRaisesRegex(RuntimeError, "argument 'top' has an entry 5 outside"):
            ops._clustered_attention_backward(torch.randn_like(out), q, k, v, labels, None, *saved, 2, 2, 0.5)
        # Unsorted top keys over several key blocks (S > 256) would index
        # outside a block: refused.
        qs, ks, vs = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 300, 4), torch.randn(1, 1, 300, 3)
        labels = ops._cluster_queries(qs, None, 2, 31, 10, 0, True)
        out, *saved = ops._clustered_attention_forward(qs, ks, vs, labels, None, 2, 2, 0.5)
        saved[2] = torch.tensor([[[[290, 3], [1, 2]]]])
        with self.assertRaisesRegex(RuntimeError, "argument 'top' must be the forward's .each row strictly increasing"):
            ops._clustered_attention_backward(torch.randn_like(out), qs, ks, vs, labels, None, *saved, 2, 2, 0.5)
        offsets, columns = ops.edge_pattern("local", 5, 1)
        # One head (H = 1) with a per-head list that does not start at 0: the
        # op takes it, so does its kernel op.
        q1, k1, v1 = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
        shifted = torch.cat([torch.tensor([0]), columns])
        self.assertEqual(attnkit.sparse_attention(q1, k1, v1, (offsets + 1).unsqueeze(0), shifted).shape, (1, 1, 5, 3))
        ops._sparse_attention_forward(q1, k1, v1, (offsets + 1).unsqueeze(0), shifted, 0.5, None)
        with self.assertRaisesRegex(RuntimeError, "_sparse_attention_forward: edge list 'columns' entry"):
            ops._sparse_attention_forward(q, k, v, offsets.unsqueeze(0), columns + 5, 0.5, None)
        with self.assertRaisesRegex(RuntimeError, "argument 'offsets' must have shape"):
            ops._sparse_attention_forward(q, k, v, offsets, columns, 0.5, None)
        with self.assertRaisesRegex(RuntimeError, "attention_dropout_mask: sizes must be >= 0"):
            ops.attention_dropout_mask(1, -1, 2, 2, 0.5, 0)


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(TORCH_2, SKIP)
class FlexCompileTest(unittest.TestCase):
    """attnkit.flex_attention under torch.compile: a block mask and a named
    modifier (traced when made, outside the compiled code, as a module makes
    it in __init__) compile without a graph break, forward and backward, the
    captured table's gradient included; a plain Python score_mod is traced
    outside the graph (a graph break, as docs/API.md says) and still runs in
    the kernel; both equal eager."""

    def setUp(self):
        torch.manual_seed(0)
        torch._dynamo.reset()

    @staticmethod
    def results(fn, q, k, v, table):
        """fn(q, k, v)'s output and the gradients of q, k, v and `table`, a
        leaf the function captures."""
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad(out.square().sum(), leaves + [table]))

    def test_named_modifier_and_block_mask_compile_without_a_graph_break(self):
        L = 200
        mask = attnkit.create_block_mask(attnkit.masks.causal(L, L), None, None, L, L, BLOCK_SIZE=64)
        q, k, v = (torch.randn(1, 4, L, 16) for _ in range(3))
        table = torch.randn(4, 32, requires_grad=True)
        relative = attnkit.score_mods.relative_buckets(table)

        def fn(q, k, v):
            return attnkit.flex_attention(q, k, v, relative, mask, softcap=20.0)

        explanation = torch._dynamo.explain(fn)(q, k, v)
        self.assertEqual(explanation.graph_break_count, 0, explanation.break_reasons)
        expected = self.results(fn, q, k, v, table)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            got = self.results(torch.compile(fn, backend=backend, fullgraph=True), q, k, v, table)
            for i, (a, e) in enumerate(zip(got, expected)):
                self.assertLess(rel_err(a, e), TOLERANCE, f"{backend}: tensor {i}")

    def test_a_plain_score_mod_breaks_the_graph_and_runs_in_the_kernel(self):
        q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
        table = torch.randn(2, 8, requires_grad=True)

        def fn(q, k, v):
            return attnkit.flex_attention(q, k, v, lambda s, b, h, i, j: s + table[h, (i - j).abs().clamp(max=7)])

        expected = self.results(fn, q, k, v, table)
        got = self.results(torch.compile(fn, backend="aot_eager"), q, k, v, table)
        for i, (a, e) in enumerate(zip(got, expected)):
            self.assertLess(rel_err(a, e), TOLERANCE, f"tensor {i}")
