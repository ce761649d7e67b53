"""torch.ops.attnkit from Python: keyword arguments, values and gradients."""
import math
import unittest

import torch

import attnkit

torch.manual_seed(0)


def composite(q, k, v, causal=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        L, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(S - L + 1), float("-inf"))
    return torch.softmax(s, -1) @ v


class OpsTest(unittest.TestCase):
    def test_softmax_matches_composite_with_keywords(self):
        q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
        for causal in (False, True):
            out = torch.ops.attnkit.softmax_attention(q, k, v, causal=causal)
            torch.testing.assert_close(out, composite(q, k, v, causal), rtol=1e-5, atol=1e-5)

    def test_key_lengths_and_empty_rows(self):
        q, k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 2)
        out = attnkit.softmax_attention(q, k, v, key_lengths=torch.tensor([0, 5]))
        self.assertTrue(torch.equal(out[0], torch.zeros_like(out[0])))
        torch.testing.assert_close(out[1:], composite(q[1:], k[1:], v[1:]))

    def test_float32_bias_gradient_matches_float64(self):
        # The float32 kernel's bias gradient, summed over the broadcast heads,
        # against the float64 composite's; bound 1e-5 relative to the largest entry.
        q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
        bias = torch.randn(1, 3, 1, 7)
        grads = []
        for dtype in (torch.float, torch.double):
            b = bias.to(dtype).clone().requires_grad_()
            out = torch.ops.attnkit.softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                                      causal=True, bias=b)
            out.sum().backward()
            grads.append(b.grad)
        self.assertEqual(grads[0].dtype, torch.float)
        err = (grads[0].double() - grads[1]).abs().max() / grads[1].abs().max()
        self.assertLess(err.item(), 1e-5)

    def test_gradients_by_finite_differences(self):
        d = dict(dtype=torch.double, requires_grad=True)
        q, k, v = torch.randn(1, 2, 4, 3, **d), torch.randn(1, 2, 5, 3, **d), torch.randn(1, 2, 5, 2, **d)
        self.assertTrue(torch.autograd.gradcheck(
            lambda q, k, v: attnkit.softmax_attention(q, k, v, causal=True), (q, k, v)))
        self.assertTrue(torch.autograd.gradcheck(
            lambda q, k, v: attnkit.linear_attention(q, k, v, feature_map="elu", normalize=True, causal=True),
            (q, k, v)))
        cq = torch.softmax(torch.randn(1, 2, 4, dtype=torch.double), 1).requires_grad_()
        cr = torch.softmax(torch.randn(1, 2, 5, dtype=torch.double), 1).requires_grad_()
        self.assertTrue(torch.autograd.gradcheck(
            lambda cq, cr, v: attnkit.agglomerative_attention(cq, cr, v, causal=True), (cq, cr, v)))

    def test_sparse_full_pattern_equals_exact(self):
        q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 3)
        offsets, columns = attnkit.edge_pattern("full", 6)
        out = attnkit.sparse_attention(q, k, v, offsets, columns)
        torch.testing.assert_close(out, composite(q, k, v), rtol=1e-5, atol=1e-5)

    def test_clustered_with_all_keys_and_seed(self):
        q, k, v = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
        a = attnkit.clustered_attention(q, k, v, clusters=4, topk=16, seed=3)
        b = attnkit.clustered_attention(q, k, v, clusters=4, topk=16, seed=3)
        self.assertTrue(torch.equal(a, b))
        torch.testing.assert_close(a, composite(q, k, v), rtol=1e-5, atol=1e-5)

    def test_bad_input_names_the_argument(self):
        q = torch.randn(1, 1, 4, 8)
        with self.assertRaisesRegex(RuntimeError, "'k'"):
            attnkit.softmax_attention(q, torch.randn(1, 1, 4, 7), torch.randn(1, 1, 4, 2))
        with self.assertRaisesRegex(RuntimeError, "clusters"):
            attnkit.clustered_attention(q, q, q, clusters=5)
        with self.assertRaisesRegex(RuntimeError, "feature_map"):
            attnkit.linear_attention(q, q, q, feature_map="relu")


if __name__ == "__main__":
    unittest.main(verbosity=2)
