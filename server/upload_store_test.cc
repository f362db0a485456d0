#include "server/upload_store.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace colod {
namespace {

v1::ModelChunk Chunk(const std::string& file, int64_t offset, const std::string& data) {
  v1::ModelChunk c;
  c.set_file(file);
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(UploadStore, WritesFilesFromOrderedChunksAndPublishesWhole) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads";
  auto store = UploadStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto w = (*store)->Begin();
  ASSERT_TRUE(w->Add(Chunk("config.json", 0, "{}")).ok());
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, "abc")).ok());
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 3, "def")).ok());
  EXPECT_FALSE((*store)->Exists("upload-000001"));  // not before Finish
  auto done = w->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->upload_id(), "upload-000001");
  EXPECT_EQ(done->bytes(), 8);
  EXPECT_TRUE((*store)->Exists("upload-000001"));
  EXPECT_EQ(Read(dir + "/upload-000001/model.safetensors"), "abcdef");

  // Out of order, a path, a file again: refused; the broken upload leaves nothing.
  auto bad = (*store)->Begin();
  ASSERT_TRUE(bad->Add(Chunk("a.safetensors", 0, "x")).ok());
  EXPECT_EQ(bad->Add(Chunk("a.safetensors", 5, "y")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->Add(Chunk("../evil", 0, "y")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->Add(Chunk("sub/dir", 0, "y")).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(bad->Add(Chunk("b.safetensors", 0, "y")).ok());
  EXPECT_EQ(bad->Add(Chunk("a.safetensors", 0, "z")).code(), absl::StatusCode::kInvalidArgument);
  bad.reset();
  EXPECT_FALSE((*store)->Exists("upload-000002"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/upload-000002.tmp"));
  EXPECT_EQ((*store)->Begin()->Finish().status().code(), absl::StatusCode::kInvalidArgument);  // no files

  // Reopened, it knows its uploads and numbers on after them.
  auto again = UploadStore::Open(dir);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->Exists("upload-000001"));
  EXPECT_EQ((*again)->Path("../etc").status().code(), absl::StatusCode::kNotFound);
  auto next = (*again)->Begin();
  ASSERT_TRUE(next->Add(Chunk("model.safetensors", 0, "q")).ok());
  EXPECT_EQ(next->Finish()->upload_id(), "upload-000002");  // failed uploads left no id behind
}

}  // namespace
}  // namespace colod
