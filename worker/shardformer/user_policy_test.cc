// A user's own model and policy, as docs/SHARDFORMER.md shows them: a
// two-layer MLP whose module tree, forward and policy live outside colod,
// sharded with ShardFormer::Optimize at tp = 2 and compared with the
// unsharded computation.
#include <sys/stat.h>

#include <fstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/status_macros.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::ExpectAllClose;
using ::colod::testing::RunMesh;

// --- the user's code (docs/SHARDFORMER.md) ---------------------------------

LayerDecl LinearDecl(const std::string& prefix, int64_t in, int64_t out) {
  LayerDecl d;
  d.kind = LayerDecl::Kind::kLinear;  // torch.nn.Linear: weight [out, in], bias [out]
  d.prefix = prefix;
  d.in = in;
  d.out = out;
  return d;
}

absl::StatusOr<ColoTensor> MlpForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("fc1", x));
  ASSIGN_OR_RETURN(Variable g, nn::Gelu(h.variable(), ops::GeluApprox::kNone));
  ASSIGN_OR_RETURN(ColoTensor act, ColoTensor::FromLocal(g, h.spec(), h.process_group()));
  return self.Call("fc2", act);
}

std::unique_ptr<Module> BuildMlp(int64_t hidden, int64_t inner) {
  auto mlp = std::make_unique<Module>("MyMlp", MlpForward);
  mlp->Add("fc1", Module::Leaf(LinearDecl("fc1", hidden, inner)));
  mlp->Add("fc2", Module::Leaf(LinearDecl("fc2", inner, hidden)));
  return mlp;
}

class MyMlpPolicy : public Policy {
 public:
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig&,
                                                                              const ShardConfig&) override {
    ModulePolicyDescription mlp;
    mlp.sub_module_replacement = {{"fc1", "Linear1D_Col"}, {"fc2", "Linear1D_Row"}};
    mlp.param_replacement = {[this](Module& m) {
      ++replaced;  // runs once per MyMlp module, after its layers are in place
      return m.Find("fc1")->layer()->type() == "Linear1D_Col" ? absl::OkStatus()
                                                               : absl::InternalError("fc1 not replaced");
    }};
    return std::map<std::string, ModulePolicyDescription>{{"MyMlp", mlp}};
  }
  int replaced = 0;
};

// A family of its own, so that ShardFormer::Load serves it from a directory.
void RegisterMyMlp() {
  ModelFamily family;
  family.parse = [](const std::string& text, const std::string& what) -> absl::StatusOr<ModelConfig> {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object() || !j.contains("hidden") || !j.contains("inner")) {
      return absl::InvalidArgumentError(what + ": hidden and inner are required");
    }
    ModelConfig c;
    c.model_type = "my_mlp";
    c.hidden_size = j["hidden"].get<int64_t>();
    c.intermediate_size = j["inner"].get<int64_t>();
    c.json = text;
    return c;
  };
  family.build = [](const ModelConfig& c) -> absl::StatusOr<std::unique_ptr<Module>> {
    return BuildMlp(c.hidden_size, c.intermediate_size);
  };
  family.policy = [] { return std::unique_ptr<Policy>(new MyMlpPolicy()); };
  ModelRegistry::Global().Register("my_mlp", family);
}

// ---------------------------------------------------------------------------

TEST(UserPolicy, ACustomModelShardsWithItsOwnPolicy) {
  const int64_t hidden = 8, inner = 16;
  const std::string dir = ::colod::testing::TempPath("my_mlp");
  ::mkdir(dir.c_str(), 0755);
  const Tensor w1 = *Tensor::RandomNormal({inner, hidden}, 1), b1 = *Tensor::RandomNormal({inner}, 2);
  const Tensor w2 = *Tensor::RandomNormal({hidden, inner}, 3), b2 = *Tensor::RandomNormal({hidden}, 4);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"fc1.weight", w1}, {"fc1.bias", b1}, {"fc2.weight", w2}, {"fc2.bias", b2}})
                  .ok());
  const Tensor x = *Tensor::RandomNormal({3, hidden}, 5);
  // Unsharded: fc2(gelu(fc1(x))).
  Variable vw1(w1, true);
  Variable want = *nn::Linear(*nn::Gelu(*nn::Linear(Variable(x), vw1, Variable(b1)), ops::GeluApprox::kNone),
                              Variable(w2), Variable(b2));
  ASSERT_TRUE(Backward(*Sum(want)).ok());

  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(2);
  shard.layout.set_data_parallel_size(1);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int rank, ProcessGroup& pg) {
    auto files = ModelFiles::Open(dir);
    ASSERT_TRUE(files.ok()) << files.status();
    MyMlpPolicy policy;
    auto model = ShardFormer(shard, &pg).Optimize(BuildMlp(hidden, inner), ModelConfig(), **files, policy);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(policy.replaced, 1);
    auto in = ColoTensor::FromLocal(Variable(x), DistSpec(), &pg);
    auto y = (*model)->root().Forward(*in);
    ASSERT_TRUE(y.ok()) << y.status();
    ExpectAllClose(y->local(), want.value(), "output", 1e-5);
    ASSERT_TRUE(Backward(*Sum(y->variable())).ok());
    auto grads = (*model)->GatherHf(/*gradients=*/true);
    ASSERT_TRUE(grads.ok()) << grads.status();
    ExpectAllClose(grads->at("fc1.weight"), *vw1.grad(), "fc1 weight gradient", 1e-5);
    // Rank k holds rows k*8..k*8+7 of fc1.
    EXPECT_EQ((*model)->Parameters()[0].bound.param.local().ToFloats(), w1.Narrow(0, rank * 8, 8)->Contiguous().ToFloats());
  });

  // The same through a registered family and a config.json.
  RegisterMyMlp();
  std::ofstream(dir + "/config.json") << R"({"model_type": "my_mlp", "hidden": 8, "inner": 16})";
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto model = ShardFormer(shard, &pg).Load(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ((*model)->root().Find("fc2")->layer()->type(), "Linear1D_Row");
    auto y = (*model)->root().Forward(*ColoTensor::FromLocal(Variable(x), DistSpec(), &pg));
    ASSERT_TRUE(y.ok()) << y.status();
    ExpectAllClose(y->local(), want.value(), "output through Load", 1e-5);
  });
}

TEST(UserPolicy, MistakesInAPolicyAreNamed) {
  const std::string dir = ::colod::testing::TempPath("my_mlp_bad");
  ::mkdir(dir.c_str(), 0755);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"x", *Tensor::Zeros({1}, DType::kF32)}}).ok());
  auto files = ModelFiles::Open(dir);
  ASSERT_TRUE(files.ok());
  struct BadPolicy : Policy {
    std::string target;
    absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig&,
                                                                                const ShardConfig&) override {
      ModulePolicyDescription d;
      d.sub_module_replacement = {{"fc1", target}};
      return std::map<std::string, ModulePolicyDescription>{{"MyMlp", d}};
    }
  };
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(2);
  shard.layout.set_data_parallel_size(1);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    BadPolicy unknown;
    unknown.target = "Linear9D";
    auto m = ShardFormer(shard, &pg).Optimize(BuildMlp(8, 16), ModelConfig(), **files, unknown);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
    EXPECT_NE(m.status().message().find("Linear9D"), std::string::npos) << m.status();
    BadPolicy wrong;
    wrong.target = "VocabParallelEmbedding1D";  // fc1 is a Linear
    m = ShardFormer(shard, &pg).Optimize(BuildMlp(8, 16), ModelConfig(), **files, wrong);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("fc1"), std::string::npos) << m.status();
    BadPolicy fine;
    fine.target = "Linear1D_Col";  // but fc1.weight is not in the checkpoint
    m = ShardFormer(shard, &pg).Optimize(BuildMlp(8, 16), ModelConfig(), **files, fine);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("fc1.weight"), std::string::npos) << m.status();
  });
}

}  // namespace
}  // namespace colod::shardformer
