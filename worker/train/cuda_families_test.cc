// Every model family trains in a tensor-parallel mode on CUDA ranks (2D,
// tp 4 as a 2 x 2 mesh of devices over NCCL: the CUDA emulation's 4 devices
// in CI) with the one-rank CPU run's losses and gradient norms: GPT-2,
// LLaMA, OPT (post-norm, project_in/out), BLOOM (ALiBi), BERT (its MLM
// head), ViT (images and labels) and T5 (input and target pairs). A family
// whose 2D layers or forward had a path only the CPU takes shows here.
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;
using testing::ExpectSameLosses;
using testing::Losses;

class CudaFamilies : public ::testing::Test {
 protected:
  void SetUp() override {
    // The default pass of a machine without a GPU builds this test and
    // does not run it; the emulation's pass and ./dev gpu-check do.
    if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  }

  // `run` (3 steps of one CPU rank) against the same in 2D on 4 CUDA ranks.
  static void ExpectTwoDOnCudaTrainsAsOneCpuRank(TrainOptions run, const std::string& what) {
    run.steps = 3;
    const std::vector<StepStats> want = Losses(run);
    ASSERT_EQ(want.size(), 3u) << what;
    TrainOptions cuda = run;
    cuda.cuda = true;
    cuda.shard.layout.set_tensor_parallel_size(4);
    cuda.shard.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
    ExpectSameLosses(Losses(cuda), want, 1e-4, what + ": 2d tp4 on CUDA");
  }
};

using Writer = absl::StatusOr<shardformer::testing::TinyModel> (*)(const std::string&,
                                                                    const shardformer::testing::TinyOptions&);

// The token models on the GPL's text, byte-level.
struct TokenFamily {
  std::string name;
  Writer write;
  shardformer::testing::TinyOptions options;
};
void PrintTo(const TokenFamily& f, std::ostream* os) { *os << f.name; }

class CudaTokenFamilies : public CudaFamilies, public ::testing::WithParamInterface<TokenFamily> {};

TEST_P(CudaTokenFamilies, TrainIn2DAsOneCpuRank) {
  const TokenFamily& f = GetParam();
  auto model = f.write(TempPath("cuda_" + f.name), f.options);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectTwoDOnCudaTrainsAsOneCpuRank(testing::SmallRun(model->dir, 1, 1, 3), f.name);
}

shardformer::testing::TinyOptions OptPostNormProjected() {
  shardformer::testing::TinyOptions o = testing::TinyByteLevel();
  o.pre_norm = false;
  o.embed_dim = 32;
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Families, CudaTokenFamilies,
    ::testing::Values(TokenFamily{"gpt2", shardformer::testing::WriteTinyGpt2, testing::TinyByteLevel()},
                      TokenFamily{"llama", shardformer::testing::WriteTinyLlama, testing::TinyByteLevel()},
                      TokenFamily{"opt", shardformer::testing::WriteTinyOpt, OptPostNormProjected()},
                      TokenFamily{"bloom", shardformer::testing::WriteTinyBloom, testing::TinyByteLevel()},
                      TokenFamily{"bert", shardformer::testing::WriteTinyBert, testing::TinyByteLevel()}),
    [](const ::testing::TestParamInfo<TokenFamily>& info) { return info.param.name; });

TEST_F(CudaFamilies, VitOnImages) {
  shardformer::testing::TinyOptions tiny;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("cuda_vit"), tiny);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const testing::ImageSet images = testing::WriteImages("cuda_vit", tiny);
  ExpectTwoDOnCudaTrainsAsOneCpuRank(
      testing::OnExamples(testing::SmallRun(vit->dir, 1, 1, 3), images.images_path, images.labels_path), "vit");
}

TEST_F(CudaFamilies, T5OnPairs) {
  const shardformer::testing::TinyOptions tiny = shardformer::testing::TinyFlanT5();
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("cuda_t5"), tiny);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const testing::PairSet pairs = testing::WritePairs("cuda_t5", t5->config.vocab_size);
  ExpectTwoDOnCudaTrainsAsOneCpuRank(
      testing::OnExamples(testing::SmallRun(t5->dir, 1, 1, 3), pairs.inputs_path, pairs.targets_path), "t5");
}

}  // namespace
}  // namespace colod::train
