// Differentiable ops against naive double-precision references and central
// differences.
#include "worker/nn/functional.h"

#include <cmath>
#include <functional>
#include <string>
#include <tuple>

#include "gtest/gtest.h"

namespace colod::nn {
namespace {

// out[b,s,h,:] = sum_t softmax_t(q[b,s,h] . k[b,t,g] * scale, t <= s if causal) v[b,t,g], g = h / group;
// with ALiBi slopes, the score of key t gains slopes[h] * t (BLOOM's form).
std::vector<double> NaiveAttention(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, int64_t batch, int64_t seq, int64_t hq, int64_t hkv,
                                   int64_t d, double scale, bool causal, const std::vector<double>& slopes = {}) {
  std::vector<double> out(batch * seq * hq * d, 0.0);
  const int64_t group = hq / hkv;
  auto at = [&](int64_t b, int64_t s, int64_t h, int64_t heads) { return ((b * seq + s) * heads + h) * d; };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t last = causal ? s : seq - 1;
        std::vector<double> w(last + 1);
        double mx = -1e300, sum = 0;
        for (int64_t t = 0; t <= last; ++t) {
          double dot = 0;
          for (int64_t j = 0; j < d; ++j) dot += q[at(b, s, h, hq) + j] * k[at(b, t, h / group, hkv) + j];
          w[t] = dot * scale + (slopes.empty() ? 0.0 : slopes[h] * static_cast<double>(t));
          mx = std::max(mx, w[t]);
        }
        for (int64_t t = 0; t <= last; ++t) sum += (w[t] = std::exp(w[t] - mx));
        for (int64_t t = 0; t <= last; ++t) {
          for (int64_t j = 0; j < d; ++j) out[at(b, s, h, hq) + j] += w[t] / sum * v[at(b, t, h / group, hkv) + j];
        }
      }
    }
  }
  return out;
}

std::vector<double> D(const Tensor& t) {
  const std::vector<float> f = t.ToFloats();
  return std::vector<double>(f.begin(), f.end());
}

// The gradients of `vars` on the tape against central differences of
// `loss` of the inputs (naive loops in double) at every element.
using Inputs = std::vector<std::vector<double>>;
void ExpectFiniteDifferenceGrads(const std::function<double(const Inputs&)>& loss, const Inputs& inputs,
                                 const std::vector<const Variable*>& vars) {
  for (size_t which = 0; which < vars.size(); ++which) {
    ASSERT_TRUE(vars[which]->grad().has_value()) << "input " << which;
    const std::vector<float> grad = vars[which]->grad()->ToFloats();
    for (size_t i = 0; i < grad.size(); ++i) {
      Inputs up = inputs, down = inputs;
      up[which][i] += 1e-6;
      down[which][i] -= 1e-6;
      const double numeric = (loss(up) - loss(down)) / 2e-6;
      ASSERT_NEAR(grad[i], numeric, 1e-4) << "input " << which << " element " << i;
    }
  }
}

// Both implementations on the CPU: the per-head GEMMs and the fused kernel's
// CPU twin (kernels/cpu FlashAttention).
class AttentionTest : public ::testing::TestWithParam<std::tuple<bool, AttentionImpl>> {};

TEST_P(AttentionTest, GroupedQueryAttentionMatchesTheNaiveLoopsAndItsGradients) {
  const bool causal = std::get<0>(GetParam());
  const AttentionImpl impl = std::get<1>(GetParam());
  const int64_t batch = 2, seq = 4, hq = 4, hkv = 2, d = 3;
  const double scale = 1 / std::sqrt(3.0);
  const Tensor q = *Tensor::RandomNormal({batch, seq, hq, d}, 1), k = *Tensor::RandomNormal({batch, seq, hkv, d}, 2),
               v = *Tensor::RandomNormal({batch, seq, hkv, d}, 3), r = *Tensor::RandomNormal({batch, seq, hq, d}, 4);
  Variable vq(q, true), vk(k, true), vv(v, true);
  auto out = Attention(vq, vk, vv, static_cast<float>(scale), causal, impl);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<double> want = NaiveAttention(D(q), D(k), D(v), batch, seq, hq, hkv, d, scale, causal);
  const std::vector<float> got = out->value().ToFloats();
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
  ASSERT_TRUE(Backward(*Sum(*Mul(*out, Variable(r)))).ok());
  const std::vector<double> rd = D(r);
  auto loss = [&](const Inputs& in) {
    const std::vector<double> o = NaiveAttention(in[0], in[1], in[2], batch, seq, hq, hkv, d, scale, causal);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * rd[i];
    return l;
  };
  ExpectFiniteDifferenceGrads(loss, {D(q), D(k), D(v)}, {&vq, &vk, &vv});
  EXPECT_EQ(Attention(vq, Variable(*Tensor::Zeros({batch, seq, 3, d}, DType::kF32)),
                      Variable(*Tensor::Zeros({batch, seq, 3, d}, DType::kF32)), 1.0f, causal, impl)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);  // 4 query heads over 3 kv heads
}

INSTANTIATE_TEST_SUITE_P(MasksAndImpls, AttentionTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(AttentionImpl::kPerHead, AttentionImpl::kFused)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "causal" : "bidirectional") +
                                  (std::get<1>(info.param) == AttentionImpl::kFused ? "_fused" : "_per_head");
                         });

// q, k and v as strided views of one packed projection [B, S, 3, H, D]
// (GPT-2's c_attn; nn::Select, no copies): the same output and gradients,
// bitwise, as the attention of contiguous copies, the gradient landing in
// the packed tensor's three parts.
TEST_P(AttentionTest, StridedOperandsOfAPackedProjectionGiveTheContiguousResult) {
  const bool causal = std::get<0>(GetParam());
  const AttentionImpl impl = std::get<1>(GetParam());
  const int64_t batch = 2, seq = 5, heads = 2, d = 4;
  const Tensor packed = *Tensor::RandomNormal({batch, seq, 3, heads, d}, 7);
  const Tensor r = *Tensor::RandomNormal({batch, seq, heads, d}, 8);
  Variable vp(packed, true);
  Variable parts[3];
  for (int i = 0; i < 3; ++i) {
    auto part = Select(vp, 2, i);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_FALSE(part->value().is_contiguous());
    EXPECT_TRUE(part->value().SharesStorageWith(packed)) << "a view, not a copy";
    parts[i] = *part;
  }
  auto out = Attention(parts[0], parts[1], parts[2], 0.5f, causal, impl);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(Backward(*Sum(*Mul(*out, Variable(r)))).ok());

  Variable copies[3];
  for (int i = 0; i < 3; ++i) copies[i] = Variable(packed.Select(2, i)->Contiguous().Clone(), true);
  auto want = Attention(copies[0], copies[1], copies[2], 0.5f, causal, impl);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(Backward(*Sum(*Mul(*want, Variable(r)))).ok());
  EXPECT_EQ(out->value().ToFloats(), want->value().ToFloats());
  ASSERT_TRUE(vp.grad().has_value());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(vp.grad()->Select(2, i)->ToFloats(), copies[i].grad()->ToFloats()) << "part " << i;
  }
  EXPECT_EQ(Select(vp, 2, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Select(vp, 5, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// T5's buckets (32 of them, max_distance 128) at every relative position in
// [-140, 140]: the first position of each bucket, as transformers'
// _relative_position_bucket gives them in torch's f32 arithmetic (worked out
// with IEEE single precision step by step). The logarithmic boundaries sit
// where truncation decides: |r| = 16 is bucket 10 (log 2 / log 16 * 8 is
// exactly 2), 15 is 9.
TEST(T5Buckets, BoundariesAsTransformersComputesThem) {
  auto check = [](bool bidirectional, const std::vector<std::pair<int64_t, int64_t>>& firsts, int64_t lo, int64_t hi) {
    // Query 140 (the last of 141) against keys 0..280: r = key - 140.
    const std::vector<int64_t> all = RelativePositionBuckets(141, 281, bidirectional, 32, 128);
    const std::vector<int64_t> got(all.begin() + 140 * 281, all.end());
    for (int64_t r = lo; r <= hi; ++r) {
      // The bucket of the listed position nearest r on r's side of 0, no further from 0 than r.
      int64_t want = -1, best = -1;
      for (const auto& [first, bucket] : firsts) {
        const bool same_side = r == 0 ? first == 0 : (r > 0 ? first > 0 : first < 0);
        if (same_side && std::abs(first) <= std::abs(r) && std::abs(first) > best) {
          best = std::abs(first);
          want = bucket;
        }
      }
      ASSERT_EQ(got[r + 140], want) << (bidirectional ? "bidirectional" : "causal") << " r = " << r;
    }
  };
  check(true,
        {{0, 0},   {-1, 1},   {-2, 2},   {-3, 3},   {-4, 4},   {-5, 5},   {-6, 6},   {-7, 7},
         {-8, 8},  {-12, 9},  {-16, 10}, {-23, 11}, {-32, 12}, {-46, 13}, {-64, 14}, {-91, 15},
         {1, 17},  {2, 18},   {3, 19},   {4, 20},   {5, 21},   {6, 22},   {7, 23},   {8, 24},
         {12, 25}, {16, 26},  {23, 27},  {32, 28},  {46, 29},  {64, 30},  {91, 31}},
        -140, 140);
  check(false,
        {{0, 0},    {-1, 1},    {-2, 2},    {-3, 3},    {-4, 4},    {-5, 5},    {-6, 6},    {-7, 7},
         {-8, 8},   {-9, 9},    {-10, 10},  {-11, 11},  {-12, 12},  {-13, 13},  {-14, 14},  {-15, 15},
         {-16, 16}, {-19, 17},  {-21, 18},  {-24, 19},  {-27, 20},  {-31, 21},  {-35, 22},  {-40, 23},
         {-46, 24}, {-52, 25},  {-59, 26},  {-67, 27},  {-77, 28},  {-87, 29},  {-99, 30},  {-113, 31}},
        -140, 0);
  // Two queries, three keys: causal keys after the query are bucket 0 (masked anyway).
  EXPECT_EQ(RelativePositionBuckets(2, 3, false, 32, 128), (std::vector<int64_t>{0, 0, 0, 1, 0, 0}));
  EXPECT_EQ(RelativePositionBuckets(2, 3, true, 32, 128), (std::vector<int64_t>{0, 17, 18, 1, 0, 17}));
}

// transformers' build_alibi_tensor for 12 heads (8 a power of two, 4 more
// between them) and for 6 (4, and 2 more), worked out by hand.
TEST(Alibi, SlopesForPowersOfTwoAndNot) {
  auto p = [](double e) { return static_cast<float>(std::pow(2.0, e)); };
  EXPECT_EQ(AlibiSlopes(12), (std::vector<float>{p(-1), p(-2), p(-3), p(-4), p(-5), p(-6), p(-7), p(-8), p(-0.5),
                                                 p(-1.5), p(-2.5), p(-3.5)}));
  EXPECT_EQ(AlibiSlopes(6), (std::vector<float>{p(-2), p(-4), p(-6), p(-8), p(-1), p(-3)}));
  EXPECT_EQ(AlibiSlopes(8), (std::vector<float>{p(-1), p(-2), p(-3), p(-4), p(-5), p(-6), p(-7), p(-8)}));
  EXPECT_EQ(AlibiSlopes(1), (std::vector<float>{p(-8)}));
}

// ALiBi's attention against the naive loops with BLOOM's bias (slope * key
// position, where colod adds slope * (key - query)), and its gradients
// against finite differences of the naive loops: the per-head GEMMs and the
// fused kernels' CPU twin (the slopes passed to the kernels).
class AlibiAttentionImpl : public ::testing::TestWithParam<AttentionImpl> {};

TEST_P(AlibiAttentionImpl, MatchesTheNaiveLoopsAndItsGradients) {
  const int64_t batch = 2, seq = 5, hq = 4, hkv = 2, d = 3;
  const double scale = 1 / std::sqrt(3.0);
  const std::vector<float> slopes = {0.5f, 0.25f, 1.5f, 0.125f};
  const std::vector<double> sd(slopes.begin(), slopes.end());
  const Tensor q = *Tensor::RandomNormal({batch, seq, hq, d}, 11), k = *Tensor::RandomNormal({batch, seq, hkv, d}, 12),
               v = *Tensor::RandomNormal({batch, seq, hkv, d}, 13), r = *Tensor::RandomNormal({batch, seq, hq, d}, 14);
  Variable vq(q, true), vk(k, true), vv(v, true);
  auto out = AlibiAttention(vq, vk, vv, static_cast<float>(scale), slopes, GetParam());
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<double> want = NaiveAttention(D(q), D(k), D(v), batch, seq, hq, hkv, d, scale, true, sd);
  const std::vector<double> plain = NaiveAttention(D(q), D(k), D(v), batch, seq, hq, hkv, d, scale, true);
  const std::vector<float> got = out->value().ToFloats();
  double moved = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5) << i;
    moved = std::max(moved, std::fabs(want[i] - plain[i]));
  }
  EXPECT_GT(moved, 1e-2);  // the slopes matter
  ASSERT_TRUE(Backward(*Sum(*Mul(*out, Variable(r)))).ok());
  const std::vector<double> rd = D(r);
  auto loss = [&](const Inputs& in) {
    const std::vector<double> o = NaiveAttention(in[0], in[1], in[2], batch, seq, hq, hkv, d, scale, true, sd);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * rd[i];
    return l;
  };
  ExpectFiniteDifferenceGrads(loss, {D(q), D(k), D(v)}, {&vq, &vk, &vv});
  EXPECT_EQ(AlibiAttention(vq, vk, vv, 1.0f, {0.5f, 0.25f}, GetParam()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Impls, AlibiAttentionImpl, ::testing::Values(AttentionImpl::kPerHead, AttentionImpl::kFused),
                         [](const auto& info) { return info.param == AttentionImpl::kFused ? "Fused" : "PerHead"; });

// Cross-attention with T5's learned bias: 3 decoder queries over 5 encoder
// keys, softmax(q k^T + bias[h]) v against naive loops in double, and the
// gradients of q, k, v and the bias against finite differences; causal
// self-attention with a bias too. The fused kernels' CPU twin (self-attention
// only: 5 queries over 5 keys, bidirectional and causal) likewise.
class BiasedAttentionImpl : public ::testing::TestWithParam<AttentionImpl> {};

TEST_P(BiasedAttentionImpl, MatchesTheNaiveLoopsAndItsGradients) {
  const bool fused = GetParam() == AttentionImpl::kFused;
  for (const bool causal : {false, true}) {
    const int64_t batch = 2, sq = causal || fused ? 5 : 3, sk = 5, hq = 2, d = 3;
    const Tensor q = *Tensor::RandomNormal({batch, sq, hq, d}, 21), k = *Tensor::RandomNormal({batch, sk, hq, d}, 22),
                 v = *Tensor::RandomNormal({batch, sk, hq, d}, 23), bias = *Tensor::RandomNormal({hq, sq, sk}, 24),
                 r = *Tensor::RandomNormal({batch, sq, hq, d}, 25);
    Variable vq(q, true), vk(k, true), vv(v, true), vb(bias, true);
    auto out = BiasedAttention(vq, vk, vv, 1.0f, causal, vb, GetParam());
    ASSERT_TRUE(out.ok()) << out.status();
    auto naive = [&](const Inputs& in) {
      std::vector<double> o(batch * sq * hq * d, 0.0);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < hq; ++h) {
          for (int64_t i = 0; i < sq; ++i) {
            const int64_t last = causal ? i : sk - 1;
            std::vector<double> w(last + 1);
            double mx = -1e300, sum = 0;
            for (int64_t t = 0; t <= last; ++t) {
              double dot = in[3][(h * sq + i) * sk + t];
              for (int64_t j = 0; j < d; ++j) {
                dot += in[0][((b * sq + i) * hq + h) * d + j] * in[1][((b * sk + t) * hq + h) * d + j];
              }
              w[t] = dot;
              mx = std::max(mx, dot);
            }
            for (int64_t t = 0; t <= last; ++t) sum += (w[t] = std::exp(w[t] - mx));
            for (int64_t t = 0; t <= last; ++t) {
              for (int64_t j = 0; j < d; ++j) {
                o[((b * sq + i) * hq + h) * d + j] += w[t] / sum * in[2][((b * sk + t) * hq + h) * d + j];
              }
            }
          }
        }
      }
      return o;
    };
    const Inputs inputs = {D(q), D(k), D(v), D(bias)};
    const std::vector<double> want = naive(inputs);
    const std::vector<float> got = out->value().ToFloats();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
    ASSERT_TRUE(Backward(*Sum(*Mul(*out, Variable(r)))).ok());
    const std::vector<double> rd = D(r);
    auto loss = [&](const Inputs& in) {
      const std::vector<double> o = naive(in);
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * rd[i];
      return l;
    };
    ExpectFiniteDifferenceGrads(loss, inputs, {&vq, &vk, &vv, &vb});
  }
  // A bias of another shape, and a causal cross-attention, are refused; the
  // fused kernels refuse a cross-attention.
  const Variable q(*Tensor::RandomNormal({1, 3, 2, 4}, 1)), kv(*Tensor::RandomNormal({1, 5, 2, 4}, 2));
  const Variable self(*Tensor::RandomNormal({1, 5, 2, 4}, 3));
  EXPECT_EQ(BiasedAttention(self, kv, kv, 1.0f, false, Variable(*Tensor::Zeros({2, 5, 4}, DType::kF32)), GetParam())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BiasedAttention(q, kv, kv, 1.0f, true, Variable(*Tensor::Zeros({2, 3, 5}, DType::kF32)), GetParam())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  if (fused) {
    EXPECT_EQ(BiasedAttention(q, kv, kv, 1.0f, false, std::nullopt, GetParam()).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // No bias (T5's cross-attention) attends as a zero bias does.
  const Variable& queries = fused ? self : q;
  const int64_t sq = queries.value().shape()[1];
  auto none = BiasedAttention(queries, kv, kv, 0.5f, false, std::nullopt, GetParam());
  auto zero =
      BiasedAttention(queries, kv, kv, 0.5f, false, Variable(*Tensor::Zeros({2, sq, 5}, DType::kF32)), GetParam());
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(none->value().ToFloats(), zero->value().ToFloats());
}

INSTANTIATE_TEST_SUITE_P(Impls, BiasedAttentionImpl, ::testing::Values(AttentionImpl::kPerHead, AttentionImpl::kFused),
                         [](const auto& info) { return info.param == AttentionImpl::kFused ? "Fused" : "PerHead"; });

TEST(Functional, ReshapeAndLinearGradients) {
  const Tensor x = *Tensor::RandomNormal({3, 4}, 5), w = *Tensor::RandomNormal({2, 4}, 6);
  Variable vx(x, true), vw(w, true);
  Variable y = *Reshape(*Linear(vx, vw, std::nullopt), {6});
  EXPECT_EQ(y.value().shape(), (Shape{6}));
  ASSERT_TRUE(Backward(*Sum(y)).ok());
  // d/dx sum(x w^T) = ones @ w: every row of dx is the column sums of w.
  const std::vector<float> wv = w.ToFloats(), dx = vx.grad()->ToFloats();
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(dx[i * 4 + j], wv[j] + wv[4 + j], 1e-6);
  }
}

// AddNorm is Add then the norm: the same sum, output and gradients (x,
// residual, gamma, beta), for LayerNorm and RMSNorm; mixed dtypes take the
// unfused path.
TEST(Functional, AddNormIsAddThenTheNorm) {
  const Tensor x = *Tensor::RandomNormal({2, 3, 8}, 11), res = *Tensor::RandomNormal({2, 3, 8}, 12),
               g = *Tensor::RandomNormal({8}, 13), b = *Tensor::RandomNormal({8}, 14),
               r1 = *Tensor::RandomNormal({2, 3, 8}, 15), r2 = *Tensor::RandomNormal({2, 3, 8}, 16);
  for (bool layer_norm : {true, false}) {
    Variable fx(x, true), fr(res, true), fg(g, true), fb(b, true), ux(x, true), ur(res, true), ug(g, true),
        ub(b, true);
    auto fused = AddNorm(fx, fr, fg, layer_norm ? std::optional<Variable>(fb) : std::nullopt, 1e-5f);
    ASSERT_TRUE(fused.ok()) << fused.status();
    Variable usum = *Add(ux, ur);
    Variable uy = layer_norm ? *LayerNorm(usum, ug, ub, 1e-5f) : *RmsNorm(usum, ug, 1e-5f);
    EXPECT_EQ(fused->sum.value().ToBytes(), usum.value().ToBytes());
    EXPECT_EQ(fused->y.value().ToBytes(), uy.value().ToBytes());
    // Both outputs feed the loss, as in a block (the sum goes on down the residual stream).
    ASSERT_TRUE(Backward(*Add(*Sum(*Mul(fused->y, Variable(r1))), *Sum(*Mul(fused->sum, Variable(r2))))).ok());
    ASSERT_TRUE(Backward(*Add(*Sum(*Mul(uy, Variable(r1))), *Sum(*Mul(usum, Variable(r2))))).ok());
    const std::string what = layer_norm ? "layer_norm" : "rms_norm";
    EXPECT_EQ(fx.grad()->ToBytes(), ux.grad()->ToBytes()) << what;
    EXPECT_EQ(fr.grad()->ToBytes(), ur.grad()->ToBytes()) << what;
    EXPECT_EQ(fg.grad()->ToBytes(), ug.grad()->ToBytes()) << what;
    if (layer_norm) {
      EXPECT_EQ(fb.grad()->ToBytes(), ub.grad()->ToBytes());
    }
  }
  // Mixed dtypes are the add's business: AddNorm answers as Add does.
  Variable half(*x.ToDType(DType::kBF16));
  auto mixed = AddNorm(half, Variable(res), Variable(g), Variable(b), 1e-5f);
  auto add = Add(half, Variable(res));
  EXPECT_EQ(mixed.status().code(), add.status().code()) << mixed.status() << " / " << add.status();
}

// A linear with the GELU epilogue is the unfused Linear then Gelu: the same
// output and the same gradients for x, w and b (f32: the fused kernels round
// x + b as BiasAdd does); without a bias, plain Gelu.
TEST(Functional, LinearWithTheGeluEpilogueIsLinearThenGelu) {
  const Tensor x = *Tensor::RandomNormal({2, 3, 5}, 7), w = *Tensor::RandomNormal({6, 5}, 8),
               b = *Tensor::RandomNormal({6}, 9), r = *Tensor::RandomNormal({2, 3, 6}, 10);
  for (auto [epilogue, approx] : {std::pair{Epilogue::kGelu, ops::GeluApprox::kNone},
                                  std::pair{Epilogue::kGeluTanh, ops::GeluApprox::kTanh}}) {
    for (bool with_bias : {true, false}) {
      Variable fx(x, true), fw(w, true), fb(b, true), ux(x, true), uw(w, true), ub(b, true);
      auto fused = Linear(fx, fw, with_bias ? std::optional<Variable>(fb) : std::nullopt, epilogue);
      ASSERT_TRUE(fused.ok()) << fused.status();
      Variable unfused = *Gelu(*Linear(ux, uw, with_bias ? std::optional<Variable>(ub) : std::nullopt), approx);
      EXPECT_EQ(fused->value().ToBytes(), unfused.value().ToBytes());
      ASSERT_TRUE(Backward(*Sum(*Mul(*fused, Variable(r)))).ok());
      ASSERT_TRUE(Backward(*Sum(*Mul(unfused, Variable(r)))).ok());
      const std::string what = with_bias ? "with a bias" : "without a bias";
      EXPECT_EQ(fx.grad()->ToBytes(), ux.grad()->ToBytes()) << what;
      EXPECT_EQ(fw.grad()->ToBytes(), uw.grad()->ToBytes()) << what;
      if (with_bias) {
        const std::vector<float> got = fb.grad()->ToFloats(), want = ub.grad()->ToFloats();
        for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << i;
      }
    }
  }
}

// An MLP, the up projection with tanh GELU in its epilogue and the down
// projection after it: the down projection takes GELU's backward into its
// input gradient's GEMM (the up projection's offer), and the gradients are
// the unfused Linear, Gelu, Linear's (f32: the bits; the bias's sums within
// rounding). The GELU output used again beside the down projection is no
// offer to take, and gives the unfused gradients too.
TEST(Functional, AnMlpsDownProjectionTakesGelusBackward) {
  const Tensor x = *Tensor::RandomNormal({2, 3, 5}, 71), w1 = *Tensor::RandomNormal({8, 5}, 72),
               b1 = *Tensor::RandomNormal({8}, 73), w2 = *Tensor::RandomNormal({4, 8}, 74),
               b2 = *Tensor::RandomNormal({4}, 75), r = *Tensor::RandomNormal({2, 3, 4}, 76),
               r8 = *Tensor::RandomNormal({2, 3, 8}, 77);
  for (bool reused : {false, true}) {
    const std::string what = reused ? "GELU's output used twice" : "one consumer";
    Variable fx(x, true), fw1(w1, true), fb1(b1, true), fw2(w2, true), fb2(b2, true);
    Variable ux(x, true), uw1(w1, true), ub1(b1, true), uw2(w2, true), ub2(b2, true);
    Variable fh = *Linear(fx, fw1, fb1, Epilogue::kGeluTanh);
    EXPECT_EQ(fh.op_name(), "linear_bias_gelu");
    Variable uh = *Gelu(*Linear(ux, uw1, ub1), ops::GeluApprox::kTanh);
    auto loss = [&](const Variable& h, const Variable& w, const Variable& b) {
      Variable f = *Sum(*Mul(*Linear(h, w, b), Variable(r)));
      return reused ? *Add(f, *Sum(*Mul(h, Variable(r8)))) : f;
    };
    ASSERT_TRUE(Backward(loss(fh, fw2, fb2)).ok()) << what;
    ASSERT_TRUE(Backward(loss(uh, uw2, ub2)).ok()) << what;
    EXPECT_EQ(fx.grad()->ToBytes(), ux.grad()->ToBytes()) << what;
    EXPECT_EQ(fw1.grad()->ToBytes(), uw1.grad()->ToBytes()) << what;
    EXPECT_EQ(fw2.grad()->ToBytes(), uw2.grad()->ToBytes()) << what;
    EXPECT_EQ(fb2.grad()->ToBytes(), ub2.grad()->ToBytes()) << what;
    const std::vector<float> got = fb1.grad()->ToFloats(), want = ub1.grad()->ToFloats();
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << what << " " << i;
  }
}

// Attention over q, k and v packed in one tensor (GPT-2's [B, S, 3, H, D] at
// dim 2, BLOOM's [B, S, H, 3, D] at dim 3 with ALiBi) is the attention over
// its three Selects: the same output, and one gradient of the packed tensor
// with the three slices' gradients (as values: the Selects' sum adds zeros,
// which turns a -0 into +0), on the fused kernels' CPU twin and on the
// per-head path. A dim that is not 3 wide is refused.
TEST(Functional, AttentionOverPackedQkvIsAttentionOverItsSlices) {
  for (bool bloom : {false, true}) {
    const Shape shape = bloom ? Shape{2, 9, 4, 3, 8} : Shape{2, 9, 3, 4, 8};
    const int64_t dim = bloom ? 3 : 2;
    const std::vector<float> slopes = AlibiSlopes(4);
    const Tensor qkv = *Tensor::RandomNormal(shape, 81), dout = *Tensor::RandomNormal({2, 9, 4, 8}, 82);
    for (AttentionImpl impl : {AttentionImpl::kFused, AttentionImpl::kPerHead}) {
      const std::string what = std::string(bloom ? "bloom" : "gpt2") +
                               (impl == AttentionImpl::kFused ? " fused" : " per head");
      Variable packed(qkv, true), apart(qkv, true);
      absl::StatusOr<Variable> p = bloom ? AlibiAttention(PackedQkv{packed, dim}, 0.35f, slopes, impl)
                                         : CausalAttention(PackedQkv{packed, dim}, 0.35f, impl);
      ASSERT_TRUE(p.ok()) << what << ": " << p.status();
      Variable parts[3];
      for (int i = 0; i < 3; ++i) parts[i] = *Select(apart, dim, i);
      Variable want = bloom ? *AlibiAttention(parts[0], parts[1], parts[2], 0.35f, slopes, impl)
                            : *Attention(parts[0], parts[1], parts[2], 0.35f, /*causal=*/true, impl);
      EXPECT_EQ(p->value().ToBytes(), want.value().ToBytes()) << what;
      if (impl == AttentionImpl::kFused) {
        EXPECT_EQ(p->op_name(), "packed_causal_attention") << what;
      }
      ASSERT_TRUE(Backward(*p, dout).ok()) << what;
      ASSERT_TRUE(Backward(want, dout).ok()) << what;
      ASSERT_EQ(packed.grad()->shape(), shape) << what;
      EXPECT_EQ(packed.grad()->ToFloats(), apart.grad()->ToFloats()) << what;
    }
  }
  // A dim counted from the end is the same slices.
  const Tensor q5 = *Tensor::RandomNormal({2, 9, 3, 4, 8}, 84);
  EXPECT_EQ(CausalAttention(PackedQkv{Variable(q5), -3}, 0.35f, AttentionImpl::kFused)->value().ToBytes(),
            CausalAttention(PackedQkv{Variable(q5), 2}, 0.35f, AttentionImpl::kFused)->value().ToBytes());
  Variable wide(*Tensor::RandomNormal({2, 9, 4, 4, 8}, 83), true);
  EXPECT_EQ(CausalAttention(PackedQkv{wide, 2}, 0.35f).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CausalAttention(PackedQkv{wide, 5}, 0.35f).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod::nn
