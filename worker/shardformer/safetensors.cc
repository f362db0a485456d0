#include "worker/shardformer/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "nlohmann/json.hpp"

namespace colod::shardformer {
namespace {

constexpr int64_t kMaxHeaderBytes = 100 << 20;  // as the reference implementation

absl::Status Invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid safetensors file: ", what));
}

// A slice is read as runs (below). A run of kDirectBytes or more is read
// straight into the tensor; shorter ones are read together, with one read
// into a buffer of up to kGatherBytes, where the gap from one to the next is
// at most kMaxGapBytes (reading a gap costs less than another read call
// there; a wider one is skipped).
constexpr int64_t kGatherBytes = int64_t{8} << 20;
constexpr int64_t kDirectBytes = int64_t{2} << 20;
constexpr int64_t kMaxGapBytes = int64_t{16} << 10;

// Reads the block [starts, starts + lengths) of the row-major array of
// element size `es` and shape `shape` that starts at byte `base` of `file`
// into the contiguous `dst`. With c the last dim on which the block is not
// the whole dim (0 when it is whole on all), the block is a sequence of
// equal runs of lengths[c] x the bytes of a step of dim c, one for each
// index of dims [0, c), in increasing file order.
absl::Status ReadBlock(const RegularFileReader& file, int64_t base, const Shape& shape, int64_t es,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths, char* dst) {
  const size_t nd = shape.size();
  std::vector<int64_t> stride(nd + 1, es);  // bytes per step of dim d; stride[nd] = es
  for (size_t d = nd; d-- > 0;) stride[d] = d + 1 < nd ? stride[d + 1] * shape[d + 1] : es;
  size_t c = nd == 0 ? 0 : nd - 1;
  while (c > 0 && starts[c] == 0 && lengths[c] == shape[c]) --c;
  const int64_t run = nd == 0 ? es : lengths[c] * stride[c];
  int64_t runs = 1;
  for (size_t d = 0; d < c; ++d) runs *= lengths[d];
  std::vector<int64_t> index(c, 0);  // of the next run, within the block
  auto offset_of = [&]() {
    int64_t at = base + (nd == 0 ? 0 : starts[c] * stride[c]);
    for (size_t d = 0; d < c; ++d) at += (starts[d] + index[d]) * stride[d];
    return at;
  };
  auto advance = [&]() {
    for (size_t d = c; d-- > 0;) {
      if (++index[d] < lengths[d]) return;
      index[d] = 0;
    }
  };
  std::string buffer;
  int64_t r = 0;
  while (r < runs) {
    const int64_t first = offset_of();
    if (run >= kDirectBytes) {
      RETURN_IF_ERROR(file.ReadAt(first, dst, static_cast<size_t>(run)));
      dst += run;
      advance();
      ++r;
      continue;
    }
    // The runs that end within a buffer from `first`, each close to the
    // one before, read with one call.
    std::vector<int64_t> offsets;
    int64_t end = first;
    while (r < runs) {
      const int64_t at = offset_of();
      if (at + run - first > kGatherBytes || (!offsets.empty() && at - end > kMaxGapBytes)) break;
      offsets.push_back(at);
      end = at + run;
      advance();
      ++r;
    }
    buffer.resize(static_cast<size_t>(end - first));
    RETURN_IF_ERROR(file.ReadAt(first, buffer.data(), buffer.size()));
    for (const int64_t at : offsets) {
      std::memcpy(dst, buffer.data() + (at - first), static_cast<size_t>(run));
      dst += run;
    }
  }
  return absl::OkStatus();
}

}  // namespace

constexpr char kReadDTypes[] = "F32, F16, BF16, I64, I32";

absl::StatusOr<DType> ParseSafetensorsDType(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I64") return DType::kI64;
  if (name == "I32") return DType::kI32;
  return absl::InvalidArgumentError(absl::StrCat("dtype ", EscapedPrefix(name, 32), " is not one of ", kReadDTypes));
}

namespace {

// Dtypes the format defines that colod does not read, with their element
// sizes in bits. A file may hold tensors of these (a model's bool
// attention-mask buffer, a u8 position table): they are validated like the
// others and listed as unreadable, so that a model whose parameters colod
// reads loads, and only a read of one of these names is refused.
std::optional<int64_t> UnreadDTypeBits(const std::string& name) {
  static const auto* const kBits = new std::map<std::string, int64_t>{
      {"BOOL", 8},        {"U8", 8},      {"I8", 8},   {"F8_E4M3", 8}, {"F8_E5M2", 8}, {"F8_E4M3FNUZ", 8},
      {"F8_E5M2FNUZ", 8}, {"F8_E8M0", 8}, {"I16", 16}, {"U16", 16},    {"U32", 32},    {"U64", 64},
      {"F64", 64},        {"C64", 64},    {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6},
  };
  auto it = kBits->find(name);
  if (it == kBits->end()) return std::nullopt;
  return it->second;
}

}  // namespace

const char* SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(RegularFileReader file, RegularFileReader::Open(path));
  const int64_t size = file.size();
  if (size < 8) {
    return Invalid(path, absl::StrCat("the file has ", size, " bytes, fewer than the 8-byte header length"));
  }
  uint64_t n = 0;
  RETURN_IF_ERROR(file.ReadAt(0, &n, 8));  // little-endian, as the format and x86/arm64 are
  if (n > static_cast<uint64_t>(kMaxHeaderBytes) || n > static_cast<uint64_t>(size - 8)) {
    return Invalid(path, absl::StrCat("the header length ", n, " does not fit the file of ", size, " bytes"));
  }
  std::string json(static_cast<size_t>(n), '\0');
  RETURN_IF_ERROR(file.ReadAt(8, json.data(), json.size()));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile(std::move(file)));
  f->data_start_ = 8 + static_cast<int64_t>(n);
  nlohmann::json header = ParseJson(json);
  if (header.is_discarded() || !header.is_object()) return Invalid(path, "the header is not a JSON object");
  const int64_t buffer = size - f->data_start_;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const std::string shown = EscapedPrefix(name, kMaxUnreadTensorNameBytes);  // (the file's bytes, in an error)
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) return Invalid(path, "__metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string())
          return Invalid(path, absl::StrCat("__metadata__ value of ", EscapedPrefix(m.key(), kMaxUnreadTensorNameBytes),
                                            " is not a string"));
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets") ||
        !e["dtype"].is_string() || !e["shape"].is_array() || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2) {
      return Invalid(path, absl::StrCat("tensor ", shown, ": the entry needs dtype, shape and two data_offsets"));
    }
    TensorInfo info;
    const std::string dtype_name = e["dtype"].get<std::string>();
    auto dtype = ParseSafetensorsDType(dtype_name);
    const std::optional<int64_t> unread_bits = dtype.ok() ? std::nullopt : UnreadDTypeBits(dtype_name);
    if (!dtype.ok() && !unread_bits.has_value()) {
      return Invalid(path, absl::StrCat("tensor ", shown, ": ", dtype.status().message(),
                                        " (nor one of the format's that colod knows)"));
    }
    if (dtype.ok()) info.dtype = *dtype;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return Invalid(path, absl::StrCat("tensor ", shown, ": a shape entry is not a size"));
      }
      info.shape.push_back(d.get<int64_t>());
    }
    const std::optional<int64_t> bits =
        CheckedBytes(info.shape, unread_bits.has_value() ? *unread_bits : 8 * static_cast<int64_t>(SizeOf(info.dtype)));
    if (!bits.has_value()) return Invalid(path, absl::StrCat("tensor ", shown, ": the shape is too large"));
    if (*bits % 8 != 0) {  // (4- and 6-bit elements are packed: the format wants whole bytes)
      return Invalid(path, absl::StrCat("tensor ", shown, ": ", dtype_name, ShapeToString(info.shape), " is ", *bits,
                                        " bits, not whole bytes"));
    }
    const std::optional<int64_t> want = *bits / 8;
    for (const auto& o : e["data_offsets"]) {
      if (!o.is_number_unsigned() || o.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return Invalid(path, absl::StrCat("tensor ", shown, ": an offset is not a size"));
      }
    }
    info.begin = e["data_offsets"][0].get<int64_t>();
    info.end = e["data_offsets"][1].get<int64_t>();
    if (info.begin > info.end || info.end > buffer) {
      return Invalid(path, absl::StrCat("tensor ", shown, ": data_offsets [", info.begin, ", ", info.end,
                                        ") are outside the ", buffer, "-byte data buffer"));
    }
    if (info.end - info.begin != *want) {
      return Invalid(path,
                     absl::StrCat("tensor ", shown, ": ", e["dtype"].get<std::string>(), ShapeToString(info.shape),
                                  " needs ", *want, " bytes but data_offsets span ", info.end - info.begin));
    }
    ranges.emplace_back(info.begin, info.end);
    if (unread_bits.has_value()) {
      f->unreadable_[name] = dtype_name;
    } else {
      f->tensors_[name] = std::move(info);
    }
  }
  // The offsets must tile the buffer: sorted, each starting where the last ended.
  std::sort(ranges.begin(), ranges.end());
  int64_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (b < at) return Invalid(path, absl::StrCat("two tensors overlap at byte ", b, " of the data buffer"));
    if (b > at) return Invalid(path, absl::StrCat("bytes [", at, ", ", b, ") of the data buffer belong to no tensor"));
    at = e;
  }
  if (at != buffer) {
    return Invalid(path, absl::StrCat("bytes [", at, ", ", buffer, ") of the data buffer belong to no tensor"));
  }
  return f;
}

absl::StatusOr<TensorInfo> SafetensorsFile::Info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    auto u = unreadable_.find(name);
    if (u != unreadable_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", name, " is ", u->second,
                                                     ", a dtype colod does not read (it reads ", kReadDTypes, ")"));
    }
    return absl::NotFoundError(absl::StrCat(path_, " has no tensor ", name));
  }
  return it->second;
}

absl::StatusOr<Tensor> SafetensorsFile::Read(const std::string& name) const {
  ASSIGN_OR_RETURN(TensorInfo info, Info(name));
  return ReadSlice(name, std::vector<int64_t>(info.shape.size(), 0), info.shape);
}

absl::StatusOr<Tensor> SafetensorsFile::ReadSlice(const std::string& name, const std::vector<int64_t>& starts,
                                                  const std::vector<int64_t>& lengths) const {
  ASSIGN_OR_RETURN(TensorInfo info, Info(name));
  if (starts.size() != info.shape.size() || lengths.size() != info.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("slice of ", name, ": ", starts.size(), " ranges for a ",
                                                   info.shape.size(), "-d tensor"));
  }
  for (size_t d = 0; d < info.shape.size(); ++d) {
    if (starts[d] < 0 || lengths[d] < 0 || starts[d] > info.shape[d] || lengths[d] > info.shape[d] - starts[d]) {
      return absl::InvalidArgumentError(absl::StrCat("slice of ", name, ": [", starts[d], ", ", starts[d] + lengths[d],
                                                     ") is outside dim ", d, " of size ", info.shape[d]));
    }
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(Shape(lengths.begin(), lengths.end()), info.dtype));
  if (out.numel() == 0) return out;
  RETURN_IF_ERROR(ReadBlock(file_, data_start_ + info.begin, info.shape, static_cast<int64_t>(SizeOf(info.dtype)),
                            starts, lengths, static_cast<char*>(out.raw_data())));
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  // A tensor in contiguous host memory is written from its own bytes; only
  // the others (on a device, or a view with strides) are copied first, each
  // when its turn comes.
  std::vector<TensorLayout> layout;
  layout.reserve(tensors.size());
  for (const auto& [name, t] : tensors) layout.push_back({name, t.dtype(), t.shape()});
  return WriteSafetensorsStreamed(
      path, layout, [&tensors](size_t i) -> absl::StatusOr<Tensor> { return tensors[i].second; }, metadata);
}

absl::Status WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorLayout>& layout,
                                      const std::function<absl::StatusOr<Tensor>(size_t i)>& make,
                                      const std::map<std::string, std::string>& metadata,
                                      const std::function<absl::Status()>& before_rename) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<int64_t> sizes;
  sizes.reserve(layout.size());
  int64_t at = 0;
  for (const TensorLayout& l : layout) {
    if (l.name.empty() || l.name == "__metadata__" || !names.insert(l.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor name '", l.name, "' is empty, reserved or repeated"));
    }
    const std::optional<int64_t> bytes = CheckedBytes(l.shape, static_cast<int64_t>(SizeOf(l.dtype)));
    if (!bytes.has_value() || at > std::numeric_limits<int64_t>::max() - *bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor ", l.name, " ", ShapeToString(l.shape), " does not fit a file"));
    }
    header[l.name] = {
        {"dtype", SafetensorsDTypeName(l.dtype)}, {"shape", l.shape}, {"data_offsets", {at, at + *bytes}}};
    at += *bytes;
    sizes.push_back(*bytes);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  char size[8];  // the header's size, little-endian
  for (int i = 0; i < 8; ++i) size[i] = static_cast<char>((uint64_t{json.size()} >> (8 * i)) & 0xff);
  return WriteFileAtomicallyStreamed(
      path,
      [&](const PieceWriter& write) -> absl::Status {
        RETURN_IF_ERROR(write(absl::string_view(size, 8)));
        RETURN_IF_ERROR(write(json));
        for (size_t i = 0; i < layout.size(); ++i) {
          ASSIGN_OR_RETURN(const Tensor t, make(i));
          if (t.dtype() != layout[i].dtype || t.shape() != layout[i].shape) {
            return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", layout[i].name, " was made ",
                                                           SafetensorsDTypeName(t.dtype()), ShapeToString(t.shape()),
                                                           ", its header says ", SafetensorsDTypeName(layout[i].dtype),
                                                           ShapeToString(layout[i].shape)));
          }
          if (!t.device().is_cuda() && t.is_contiguous()) {
            RETURN_IF_ERROR(
                write(absl::string_view(static_cast<const char*>(t.raw_data()), static_cast<size_t>(sizes[i]))));
          } else {
            ASSIGN_OR_RETURN(const std::string copy, t.ReadBytes());
            RETURN_IF_ERROR(write(copy));
          }
        }
        return absl::OkStatus();
      },
      before_rename != nullptr ? before_rename : [] { return absl::OkStatus(); });
}

}  // namespace colod::shardformer
