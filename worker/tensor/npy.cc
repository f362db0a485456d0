#include "worker/tensor/npy.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/host_memory.h"
#include "common/int_math.h"
#include "common/little_endian.h"
#include "common/npy_header.h"
#include "common/status_macros.h"

namespace colod {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

absl::Status Bad(const std::string& what, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": not a supported .npy array: ", why));
}

// The value of 'key' in the header dict, as text (a quoted string, a word or
// a parenthesized tuple).
absl::StatusOr<std::string> DictValue(absl::string_view dict, absl::string_view key, const std::string& what) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t at = dict.find(quoted);
  if (at == absl::string_view::npos) return Bad(what, absl::StrCat("the header has no ", quoted));
  at = dict.find(':', at + quoted.size());
  if (at == absl::string_view::npos) return Bad(what, absl::StrCat("no value for ", quoted));
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(dict.substr(at + 1));
  if (absl::ConsumePrefix(&rest, "'")) {
    const size_t end = rest.find('\'');
    if (end == absl::string_view::npos) return Bad(what, "an unterminated string");
    return std::string(rest.substr(0, end));
  }
  if (absl::ConsumePrefix(&rest, "(")) {
    const size_t end = rest.find(')');
    if (end == absl::string_view::npos) return Bad(what, "an unterminated shape tuple");
    return std::string(rest.substr(0, end));
  }
  const size_t end = rest.find_first_of(",}");
  return std::string(absl::StripAsciiWhitespace(rest.substr(0, end)));
}

}  // namespace

namespace {

// A .npy file's header, from the first bytes of the file (at least up to
// the end of the header).
struct Header {
  std::string descr, shape_text;
  Shape shape;
  size_t data_offset = 0;  // where the array starts
};

absl::StatusOr<Header> ParseHeader(absl::string_view bytes, const std::string& what) {
  if (bytes.size() < 10 || bytes.substr(0, 6) != absl::string_view(kMagic, 6)) return Bad(what, "no \\x93NUMPY magic");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = LoadLittleEndian(reinterpret_cast<const unsigned char*>(bytes.data()) + 8, 2);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Bad(what, "a truncated header");
    header_len = LoadLittleEndian(reinterpret_cast<const unsigned char*>(bytes.data()) + 8, 4);
    offset = 12;
  } else {
    return Bad(what, absl::StrCat("format version ", major, " is not 1, 2 or 3"));
  }
  // numpy writes versions 2 and 3 only for headers past 65535 bytes (many
  // fields of a structured dtype): none colod reads.
  constexpr size_t kMaxHeaderBytes = 65535;
  if (header_len > kMaxHeaderBytes) {
    return Bad(what, absl::StrCat("its header is ", header_len, " bytes; colod reads headers of at most ",
                                  kMaxHeaderBytes, " (plain arrays of one dtype)"));
  }
  if (offset + header_len > bytes.size()) return Bad(what, "the header runs past the end of the file");
  const absl::string_view dict(bytes.data() + offset, header_len);
  Header h;
  h.data_offset = offset + header_len;
  ASSIGN_OR_RETURN(h.descr, DictValue(dict, "descr", what));
  ASSIGN_OR_RETURN(std::string fortran, DictValue(dict, "fortran_order", what));
  ASSIGN_OR_RETURN(h.shape_text, DictValue(dict, "shape", what));
  if (fortran != "False") return Bad(what, "fortran_order arrays are not supported; save in C order");
  for (absl::string_view part : absl::StrSplit(h.shape_text, ',', absl::SkipWhitespace())) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return Bad(what, absl::StrCat("the shape (", h.shape_text, ") is not a tuple of sizes"));
    }
    h.shape.push_back(d);
  }
  return h;
}

// The bytes an element of `descr` takes in the file; 0 for a dtype colod
// does not read.
int64_t ElementBytes(absl::string_view descr) {
  if (descr == "<f4" || descr == "<i4" || descr == "<u4") return 4;
  if (descr == "<f2" || descr == "<u2") return 2;
  if (descr == "<i8") return 8;
  return 0;
}

}  // namespace

absl::StatusOr<NpyInfo> ReadNpyInfo(const std::string& path) {
  // A regular file, never waited on in open (a FIFO in its place).
  ASSIGN_OR_RETURN(const RegularFileReader file, RegularFileReader::Open(path));
  // The header: at most 65535 bytes (ParseHeader refuses longer ones),
  // after 10 or 12 bytes of magic, version and length.
  std::string prefix(static_cast<size_t>(std::min<int64_t>(12 + 65535, file.size())), '\0');
  RETURN_IF_ERROR(file.ReadAt(0, prefix.data(), prefix.size()));
  ASSIGN_OR_RETURN(const Header h, ParseHeader(prefix, path));
  NpyInfo info;
  info.descr = h.descr;
  info.element_bytes = ElementBytes(h.descr);
  info.widened = h.descr == "<u2" || h.descr == "<u4";
  info.tensor_element_bytes = info.widened ? 8 : info.element_bytes;
  const std::optional<int64_t> elements = CheckedProduct(h.shape);
  if (!elements.has_value()) return Bad(path, absl::StrCat("the shape (", h.shape_text, ") is too large"));
  info.elements = *elements;
  info.integer = h.descr == "<i8" || h.descr == "<i4" || h.descr == "<u2" || h.descr == "<u4";
  return info;
}

absl::StatusOr<Tensor> ParseNpy(const std::string& bytes, const std::string& what) {
  ASSIGN_OR_RETURN(const Header h, ParseHeader(bytes, what));
  const std::string& descr = h.descr;
  const std::string& shape_text = h.shape_text;
  const Shape& shape = h.shape;
  const absl::string_view data(bytes.data() + h.data_offset, bytes.size() - h.data_offset);
  const std::optional<int64_t> elements = CheckedProduct(shape);
  if (!elements.has_value()) return Bad(what, absl::StrCat("the shape (", shape_text, ") is too large"));
  const int64_t n = *elements;
  auto expect = [&](size_t es) -> absl::Status {
    const std::optional<int64_t> need = CheckedBytes(shape, static_cast<int64_t>(es));
    if (!need.has_value()) return Bad(what, absl::StrCat("the shape (", shape_text, ") of ", descr, " is too large"));
    if (static_cast<int64_t>(data.size()) != *need) {
      return Bad(what, absl::StrCat("shape (", shape_text, ") of ", descr, " needs ", *need, " bytes, the file has ",
                                    data.size()));
    }
    return absl::OkStatus();
  };
  const size_t es = static_cast<size_t>(ElementBytes(descr));
  if (es == 0) return Bad(what, absl::StrCat("dtype '", descr, "' is not one of <f4, <f2, <i8, <i4, <u2, <u4"));
  RETURN_IF_ERROR(expect(es));
  if (descr == "<f4" || descr == "<f2" || descr == "<i8" || descr == "<i4") {
    const DType t = descr == "<f4" ? DType::kF32 : descr == "<f2" ? DType::kF16 : descr == "<i8" ? DType::kI64 : DType::kI32;
    return Tensor::FromBytes(shape, t, data);
  }
  std::vector<int64_t> v(n);  // <u2, <u4: widened to i64
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x = 0;
    std::memcpy(&x, data.data() + i * es, es);
    v[i] = x;
  }
  return Tensor::FromInt64s(shape, v);
}

std::optional<int64_t> NpyReadPeakBytes(const NpyInfo& info, int64_t file_bytes) {
  if (info.element_bytes <= 0) return file_bytes;  // refused after the header
  const int64_t elements = std::min(info.elements, file_bytes / info.element_bytes);
  const std::optional<int64_t> tensor = CheckedMul(elements, info.tensor_element_bytes);
  const std::optional<int64_t> vector = CheckedMul(elements, info.widened ? 8 : 0);
  if (!tensor.has_value() || !vector.has_value()) return std::nullopt;
  const std::optional<int64_t> both = CheckedAdd(*tensor, *vector);
  return both.has_value() ? CheckedAdd(file_bytes, *both) : std::nullopt;
}

absl::StatusOr<Tensor> ReadNpy(const std::string& path, NpySource source) {
  // One copy of the bytes, a read error an error (not a shorter array), a
  // device, a FIFO (whose writer could hold the rank in a read no abort
  // ends) or a directory refused; none that would not fit.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", std::strerror(err)));
    }
    return FileError("cannot read", path, err);
  }
  const bool pipe = S_ISFIFO(st.st_mode) && source == NpySource::kRegularFileOrPipe;
  if (!S_ISREG(st.st_mode) && !pipe) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", S_ISDIR(st.st_mode) ? "a directory" : "not a regular file (a FIFO or a device)", ", not a .npy file"));
  }
  if (!pipe) {
    ASSIGN_OR_RETURN(const NpyInfo info, ReadNpyInfo(path));
    const std::optional<int64_t> peak = NpyReadPeakBytes(info, st.st_size);
    const int64_t available = AvailableHostMemoryBytes();
    if (!peak.has_value() || *peak > available) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: reading its %s array of %d elements takes %s of memory, and %.1f GiB is available", path, info.descr,
          info.elements, peak.has_value() ? absl::StrFormat("%.1f GiB", *peak / double{1 << 30}) : "over 8 EiB",
          available / double{1 << 30}));
    }
  }
  // A regular file: at most the bytes its memory check measured (a FIFO
  // fed without end in its place is not read past them).
  ASSIGN_OR_RETURN(const std::string bytes, pipe ? ReadFileToString(path) : ReadFileToString(path, st.st_size));
  return ParseNpy(bytes, path);
}

absl::StatusOr<std::string> SerializeNpy(const Tensor& t) {
  const char* descr = nullptr;
  switch (t.dtype()) {
    case DType::kF32: descr = "<f4"; break;
    case DType::kF16: descr = "<f2"; break;
    case DType::kI64: descr = "<i8"; break;
    case DType::kI32: descr = "<i4"; break;
    case DType::kBF16: return absl::InvalidArgumentError(".npy has no bf16; convert to f32 first");
  }
  std::string out = NpyHeader(descr, t.shape());
  ASSIGN_OR_RETURN(const std::string bytes, t.ReadBytes());
  out += bytes;
  return out;
}

absl::Status WriteNpy(const std::string& path, const Tensor& t) {
  ASSIGN_OR_RETURN(std::string bytes, SerializeNpy(t));
  return WriteFileAtomically(path, bytes);
}

}  // namespace colod
