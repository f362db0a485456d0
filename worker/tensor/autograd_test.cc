#include "worker/tensor/autograd.h"

#include "common/status_macros.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

Variable Leaf(const Shape& shape, uint64_t seed) { return Variable(*Tensor::RandomNormal(shape, seed), true); }

TEST(Autograd, GradientsMatchTheClosedForm) {
  // f = sum(3 * (x*y + x) - y): df/dx = 3(y + 1), df/dy = 3x - 1.
  Variable x = Leaf({4, 5}, 1), y = Leaf({4, 5}, 2);
  Variable xy = *Mul(x, y);
  Variable f = *Sum(*Sub(*Scale(*Add(xy, x), 3.0f), y));
  EXPECT_EQ(f.op_name(), "sum");
  ASSERT_TRUE(Backward(f).ok());
  std::vector<float> xv = x.value().ToFloats(), yv = y.value().ToFloats();
  std::vector<float> gx = x.grad()->ToFloats(), gy = y.grad()->ToFloats();
  for (size_t i = 0; i < xv.size(); ++i) {
    // fp32: the tape computes 3y + 3, the closed form 3(y + 1).
    EXPECT_NEAR(gx[i], 3.0f * (yv[i] + 1.0f), 1e-5f);
    EXPECT_NEAR(gy[i], 3.0f * xv[i] - 1.0f, 1e-5f);
  }
  // A second backward accumulates.
  Variable f2 = *Sum(*Mul(x, x));  // d/dx = 2x
  ASSERT_TRUE(Backward(f2).ok());
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(x.grad()->ToFloats()[i], 3.0f * (yv[i] + 1.0f) + 2.0f * xv[i], 1e-5f);
  x.ZeroGrad();
  EXPECT_FALSE(x.grad().has_value());
}

// A leaf keeps the gradient backward made for it where nothing else holds
// that tensor (no copy), and a copy where something does: add's backward
// hands its one gradient to both inputs, whose gradients must not share
// memory (accumulating into one would change the other).
TEST(Autograd, ALeafKeepsAFreshGradientAndCopiesASharedOne) {
  Variable x = Leaf({3, 4}, 11), y = Leaf({3, 4}, 12), w = Leaf({3, 4}, 13);
  Variable out = *Add(*Mul(w, w), *Add(x, y));
  ASSERT_TRUE(Backward(*Sum(out)).ok());
  ASSERT_TRUE(x.grad().has_value() && y.grad().has_value() && w.grad().has_value());
  EXPECT_FALSE(x.grad()->SharesStorageWith(*y.grad())) << "x and y were given one gradient tensor";
  Tensor gx = *x.grad();
  ASSERT_TRUE(AddInPlace(gx, *Tensor::FromFloats({3, 4}, std::vector<float>(12, 5.0f))).ok());
  EXPECT_EQ(y.grad()->ToFloats(), std::vector<float>(12, 1.0f)) << "x's accumulation reached y's gradient";
  EXPECT_EQ(x.grad()->ToFloats(), std::vector<float>(12, 6.0f));
  const std::vector<float> wv = w.value().ToFloats(), gw = w.grad()->ToFloats();
  for (size_t i = 0; i < wv.size(); ++i) EXPECT_FLOAT_EQ(gw[i], 2.0f * wv[i]);
  // Tensor::IsSoleHandle: the only handle of all of its storage.
  Tensor t = *Tensor::Zeros({4, 2}, DType::kF32);
  EXPECT_TRUE(t.IsSoleHandle());
  {
    Tensor copy = t;
    EXPECT_FALSE(t.IsSoleHandle());
  }
  EXPECT_TRUE(t.IsSoleHandle());
  Tensor part = *t.Narrow(0, 1, 2);
  t = Tensor();
  EXPECT_FALSE(part.IsSoleHandle()) << "a view of part of its storage";
  Tensor transposed = *Tensor::Zeros({4, 2}, DType::kF32)->Transpose(0, 1);
  EXPECT_FALSE(transposed.IsSoleHandle()) << "not contiguous";
}

TEST(Autograd, GradientStorageHoldsTheGradientInPlace) {
  // d/dx sum(x * x) = 2x, written into the storage given (a view into a
  // larger buffer, as a data-parallel bucket), accumulated there in place.
  Variable x = Leaf({3, 4}, 5);
  Tensor bucket = *Tensor::Zeros({20}, DType::kF32);
  Tensor view = *bucket.Narrow(0, 4, 12)->Reshape({3, 4});
  ASSERT_TRUE(x.SetGradStorage(view).ok());
  ASSERT_TRUE(Backward(*Sum(*Mul(x, x))).ok());
  ASSERT_TRUE(x.grad().has_value());
  EXPECT_TRUE(x.grad()->SharesStorageWith(bucket));
  const std::vector<float> xv = x.value().ToFloats();
  std::vector<float> twice(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) twice[i] = 2.0f * xv[i];
  EXPECT_EQ(view.ToFloats(), twice);
  ASSERT_TRUE(Backward(*Sum(*Mul(x, x))).ok());  // accumulates in the view
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(view.ToFloats()[i], 4.0f * xv[i]);
  const std::vector<float> b = bucket.ToFloats();
  for (int i : {0, 1, 2, 3, 16, 17, 18, 19}) EXPECT_EQ(b[i], 0.0f) << "outside the view at " << i;
  // ZeroGrad keeps the storage: the next gradient overwrites it (no stale sum).
  x.ZeroGrad();
  EXPECT_FALSE(x.grad().has_value());
  ASSERT_TRUE(Backward(*Sum(x)).ok());
  EXPECT_TRUE(x.grad()->SharesStorageWith(bucket));
  EXPECT_EQ(view.ToFloats(), std::vector<float>(12, 1.0f));
  // Back to allocating (the gradient taken so far stays); storage of
  // another shape or dtype is refused.
  ASSERT_TRUE(x.SetGradStorage(std::nullopt).ok());
  EXPECT_TRUE(x.grad()->SharesStorageWith(bucket));
  x.ZeroGrad();
  ASSERT_TRUE(Backward(*Sum(x)).ok());
  EXPECT_FALSE(x.grad()->SharesStorageWith(bucket));
  EXPECT_EQ(x.grad()->ToFloats(), std::vector<float>(12, 1.0f));
  EXPECT_EQ(x.SetGradStorage(*Tensor::Zeros({4, 3}, DType::kF32)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(x.SetGradStorage(*Tensor::Zeros({3, 4}, DType::kBF16)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Autograd, AVariableUsedTwiceGetsBothContributions) {
  Variable x = Leaf({3}, 4);
  Variable f = *Sum(*Add(*Scale(x, 2.0f), *Scale(x, 5.0f)));
  ASSERT_TRUE(Backward(f).ok());
  for (float g : x.grad()->ToFloats()) EXPECT_FLOAT_EQ(g, 7.0f);
}

// y = 2 x recorded with a folding backward: dx = 2 dy, plus input 0's
// gradient so far where `fold` (the sum computed here, returned folded); the
// pending gradients it saw are counted in `seen`.
Variable Doubled(const Variable& x, bool fold, std::vector<bool>* seen) {
  return RecordFoldingOp("doubled", {x}, *Scale(x.value(), 2.0f),
                         [fold, seen](const Tensor& dy, const Tensor* pending) -> absl::StatusOr<FoldedGrads> {
                           seen->push_back(pending != nullptr);
                           ASSIGN_OR_RETURN(Tensor dx, Scale(dy, 2.0f));
                           if (fold && pending != nullptr) {
                             ASSIGN_OR_RETURN(dx, Add(*pending, dx));
                             return FoldedGrads{{dx}, true};
                           }
                           return FoldedGrads{{dx}, false};
                         });
}

// A folding backward sees its first input's gradient so far (what the ops
// recorded after it gave that input) and, where it folds it in, Backward
// takes the result in its place: the gradients are those of the sum either
// way, never the pending part twice. With no later consumer it sees none;
// a leaf's pending gradient is offered too. A fold that returns no gradient
// for the input is an error.
TEST(Autograd, AFoldingBackwardTakesItsInputsPendingGradient) {
  for (bool fold : {true, false}) {
    SCOPED_TRACE(fold ? "folded" : "added by Backward");
    // f = sum(2 h + h), h = x * x: df/dh = 3, df/dx = 6 x.
    Variable x = Leaf({3, 4}, 41);
    std::vector<bool> seen;
    Variable h = *Mul(x, x);
    ASSERT_TRUE(Backward(*Sum(*Add(Doubled(h, fold, &seen), h))).ok());
    EXPECT_EQ(seen, std::vector<bool>{true});  // add's share came first
    const std::vector<float> xv = x.value().ToFloats(), gx = x.grad()->ToFloats();
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(gx[i], 6.0f * xv[i], 1e-5f) << i;
    // The only consumer: nothing pending. A leaf: its pending gradient.
    Variable y = Leaf({3, 4}, 42);
    seen.clear();
    ASSERT_TRUE(Backward(*Sum(Doubled(y, fold, &seen))).ok());
    EXPECT_EQ(seen, std::vector<bool>{false});
    for (float g : y.grad()->ToFloats()) EXPECT_EQ(g, 2.0f);
    y.ZeroGrad();
    seen.clear();
    ASSERT_TRUE(Backward(*Sum(*Add(Doubled(y, fold, &seen), y))).ok());
    EXPECT_EQ(seen, std::vector<bool>{true});
    for (float g : y.grad()->ToFloats()) EXPECT_EQ(g, 3.0f);
  }
  Variable z = Leaf({2}, 43);
  Variable broken = RecordFoldingOp("broken", {z}, z.value(), [](const Tensor&, const Tensor*) {
    return absl::StatusOr<FoldedGrads>(FoldedGrads{{std::nullopt}, true});
  });
  const absl::Status st = Backward(*Sum(*Add(broken, z)));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("backward of broken"), std::string::npos) << st;
}

// h = x * x offering its consumer to take the gradient on through h's
// derivative (2x at `pre` = x); which of its backwards ran is counted.
struct OfferCounts {
  int own = 0, offered = 0;
};
Variable Squared(const Variable& x, OfferCounts* counts) {
  const Tensor xv = x.value();
  return RecordOfferingOp(
      "squared", {x}, *Mul(xv, xv),
      [xv, counts](const Tensor& dh) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
        ++counts->own;
        ASSIGN_OR_RETURN(Tensor dx, Mul(dh, *Scale(xv, 2.0f)));
        return std::vector<std::optional<Tensor>>{dx};
      },
      GeluGradOffer{xv, [counts](const Tensor& dz) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                      ++counts->offered;  // dz is the gradient at x already
                      return std::vector<std::optional<Tensor>>{dz};
                    }});
}
// y = 3 * in (named `uses` times among its inputs), taking an offer (as
// 3 * dy * 2 * pre) where `take` and one comes; whether one came is counted.
Variable Tripled(const Variable& in, bool take, int uses, std::vector<bool>* offered) {
  std::vector<Variable> inputs(static_cast<size_t>(uses), in);
  return RecordOfferTakingOp(
      "tripled", inputs, *Scale(in.value(), 3.0f * static_cast<float>(uses)),
      [take, uses, offered](const Tensor& dy, const GeluGradOffer* offer) -> absl::StatusOr<OfferedGrads> {
        offered->push_back(offer != nullptr);
        ASSIGN_OR_RETURN(Tensor g, Scale(dy, 3.0f));
        OfferedGrads out;
        out.grads.assign(static_cast<size_t>(uses), g);
        if (take && offer != nullptr) {
          ASSIGN_OR_RETURN(out.grads[0], Mul(g, *Scale(offer->pre, 2.0f)));
          out.taken = true;
        }
        return out;
      });
}

// An offering op's offer reaches the one op consuming its output: taken,
// that op's gradient for it is already through the offering op's
// derivative and Backward runs the offer's backward in place of the op's
// own, with the same gradients. Not offered where another op consumes the
// output too, or the consumer names it twice; declined, the op's own
// backward runs. A backward that takes an offer it was not given, or gives
// no gradient with it, is an error.
TEST(Autograd, AnOffersDerivativeIsTakenByItsOnlyConsumer) {
  for (bool take : {true, false}) {
    SCOPED_TRACE(take ? "taken" : "declined");
    // f = sum(3 x^2): df/dx = 6x.
    Variable x = Leaf({3, 4}, 51);
    OfferCounts counts;
    std::vector<bool> offered;
    ASSERT_TRUE(Backward(*Sum(Tripled(Squared(x, &counts), take, 1, &offered))).ok());
    EXPECT_EQ(offered, std::vector<bool>{true});
    EXPECT_EQ(counts.offered, take ? 1 : 0);
    EXPECT_EQ(counts.own, take ? 0 : 1);
    const std::vector<float> xv = x.value().ToFloats(), gx = x.grad()->ToFloats();
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(gx[i], 6.0f * xv[i], 1e-5f) << i;
  }
  for (bool other_first : {false, true}) {
    // f = sum(3 h + 2 h), h = x^2: two consumers, no offer, whichever
    // Backward reaches first (the other recorded before the taker: it runs
    // after it, nothing pending yet when the taker runs); df/dx = 10x.
    SCOPED_TRACE(other_first ? "the other consumer recorded first" : "the taker recorded first");
    Variable x = Leaf({3, 4}, 52);
    OfferCounts counts;
    std::vector<bool> offered;
    Variable h = Squared(x, &counts);
    Variable other, taker;
    if (other_first) {
      other = *Scale(h, 2.0f);
      taker = Tripled(h, true, 1, &offered);
    } else {
      taker = Tripled(h, true, 1, &offered);
      other = *Scale(h, 2.0f);
    }
    ASSERT_TRUE(Backward(*Sum(*Add(taker, other))).ok());
    EXPECT_EQ(offered, std::vector<bool>{false});
    EXPECT_EQ(counts.own, 1);
    EXPECT_EQ(counts.offered, 0);
    const std::vector<float> xv = x.value().ToFloats(), gx = x.grad()->ToFloats();
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(gx[i], 10.0f * xv[i], 1e-5f) << i;
  }
  {  // f = sum(6 h) with h named twice by its consumer: no offer; df/dx = 12x.
    Variable x = Leaf({3, 4}, 53);
    OfferCounts counts;
    std::vector<bool> offered;
    ASSERT_TRUE(Backward(*Sum(Tripled(Squared(x, &counts), true, 2, &offered))).ok());
    EXPECT_EQ(offered, std::vector<bool>{false});
    EXPECT_EQ(counts.own, 1);
    const std::vector<float> xv = x.value().ToFloats(), gx = x.grad()->ToFloats();
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(gx[i], 12.0f * xv[i], 1e-5f) << i;
  }
  Variable z = Leaf({2}, 54);
  Variable rogue = RecordOfferTakingOp("rogue", {z}, z.value(), [](const Tensor& dy, const GeluGradOffer*) {
    return absl::StatusOr<OfferedGrads>(OfferedGrads{{dy}, true});
  });
  absl::Status st = Backward(*Sum(rogue));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("backward of rogue"), std::string::npos) << st;
  OfferCounts counts;
  Variable empty = RecordOfferTakingOp("empty", {Squared(z, &counts)}, z.value(),
                                       [](const Tensor&, const GeluGradOffer* offer) {
                                         return absl::StatusOr<OfferedGrads>(OfferedGrads{{std::nullopt}, offer != nullptr});
                                       });
  st = Backward(*Sum(empty));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("backward of empty"), std::string::npos) << st;
}

TEST(Autograd, NoGradScopeRecordsNothing) {
  Variable x = Leaf({3}, 4);
  {
    NoGradScope no_grad;
    EXPECT_FALSE(GradEnabled());
    Variable y = *Scale(x, 2.0f);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
  }
  EXPECT_TRUE(GradEnabled());
  Variable constant(*Tensor::RandomNormal({3}, 5));  // requires no grad
  Variable y = *Mul(x, constant);
  EXPECT_TRUE(y.requires_grad());
  ASSERT_TRUE(Backward(*Sum(y)).ok());
  EXPECT_FALSE(constant.grad().has_value());
  EXPECT_EQ(x.grad()->ToFloats(), constant.value().ToFloats());
}

TEST(Autograd, RootsMustBeScalarOrSeeded) {
  Variable x = Leaf({2, 2}, 1);
  Variable y = *Scale(x, 2.0f);
  EXPECT_EQ(Backward(y).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(Backward(y, *Tensor::FromFloats({2, 2}, {1, 2, 3, 4})).ok());
  EXPECT_EQ(x.grad()->ToFloats(), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(Backward(Variable(*Tensor::Zeros({}, DType::kF32))).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Autograd, BackwardRunsNodesInReverseRecordingOrder) {
  std::vector<std::string> order;
  Variable x = Leaf({1}, 1);
  auto op = [&](const std::string& name, const Variable& in) {
    return RecordOp(name, {in}, in.value().Clone(), [&order, name](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
      order.push_back(name);
      return std::vector<std::optional<Tensor>>{g};
    });
  };
  Variable a = op("first", x);
  Variable b = op("second", x);
  Variable c = *Add(a, b);
  Variable d = op("third", c);
  ASSERT_TRUE(Backward(*Sum(d)).ok());
  EXPECT_EQ(order, (std::vector<std::string>{"third", "second", "first"}));
}

}  // namespace
}  // namespace colod

namespace colod {
namespace {

TEST(Autograd, GradReadyHooksFireAsSoonAsALeafIsComplete) {
  Variable w1(*Tensor::FromFloats({2}, {1, 2}), true), w2(*Tensor::FromFloats({2}, {3, 4}), true);
  const Variable x(*Tensor::FromFloats({2}, {5, 6}));
  std::vector<std::string> log;
  w1.SetGradReadyHook([&] { log.push_back("w1 " + std::to_string(w1.grad()->ToFloats()[1])); });
  w2.SetGradReadyHook([&] { log.push_back("w2 " + std::to_string(w2.grad()->ToFloats()[1])); });
  // a = w1 * x through an op that logs its backward; loss = sum(a * w2 + w2).
  Variable a = RecordOp("logged_mul", {w1}, Mul(w1, x)->value().Clone(), [&](const Tensor& dy) {
    log.push_back("op1");
    return absl::StatusOr<std::vector<std::optional<Tensor>>>(std::vector<std::optional<Tensor>>{*Mul(dy, x.value())});
  });
  Variable loss = *Sum(*Add(*Mul(a, w2), w2));
  ASSERT_TRUE(Backward(loss).ok());
  // w2 (consumed by the last two ops) is complete before op1's backward runs.
  EXPECT_EQ(log, (std::vector<std::string>{"w2 " + std::to_string(13.0f), "op1", "w1 " + std::to_string(24.0f)}));
  EXPECT_EQ(w2.grad()->ToFloats(), (std::vector<float>{6, 13}));  // a + 1 = w1 * x + 1
  EXPECT_EQ(w1.grad()->ToFloats(), (std::vector<float>{15, 24}));  // x * w2
}

}  // namespace
}  // namespace colod
