#include "client/format.h"

#include <cmath>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "spec/plan.h"
#include "common/half.h"
#include "common/int_math.h"
#include "common/npy_header.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace colod {
namespace {

std::string EnumSuffix(const std::string& name, const std::string& prefix) {
  std::string out = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string Age(const google::protobuf::Timestamp& ts, absl::Time now) {
  if (ts.seconds() == 0 && ts.nanos() == 0) return "-";
  absl::Duration d = now - FromProtoTimestamp(ts);
  if (d < absl::ZeroDuration()) d = absl::ZeroDuration();
  return absl::StrFormat("%.1fs ago", absl::ToDoubleSeconds(d));
}

}  // namespace

std::string RenderTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size() && c < width.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      absl::StrAppend(&l, cell);
      if (c + 1 < width.size()) l.append(width[c] - cell.size() + 2, ' ');
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    absl::StrAppend(&out, l, "\n");
  };
  line(header);
  for (const auto& r : rows) line(r);
  return out;
}

std::string RenderWorkersTable(const std::vector<v1::Worker>& workers, absl::Time now) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Worker& w : workers) {
    const v1::WorkerInfo& i = w.info();
    std::string device = EnumSuffix(v1::DeviceKind_Name(i.device_kind()), "DEVICE_KIND_");
    if (i.device_kind() == v1::DEVICE_KIND_CUDA) {
      absl::StrAppend(&device, ":", i.device_ordinal(), " (", i.device_name(), ")");
    }
    std::string state = EnumSuffix(v1::WorkerState_Name(w.state()), "WORKER_STATE_");
    if (!w.lost_reason().empty()) absl::StrAppend(&state, " (", w.lost_reason(), ")");
    // (A rolling upgrade's workers of two versions: the placement's waiting
    // reason may name the older ones.)
    rows.push_back({i.worker_id(), i.address(), i.host(), device, state, Age(w.last_heartbeat_time(), now),
                    i.version().empty() ? "-" : i.version()});
  }
  return RenderTable({"ID", "ADDRESS", "HOST", "DEVICE", "STATE", "LAST HEARTBEAT", "VERSION"}, rows);
}

absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = pretty;
  opts.always_print_primitive_fields = true;
  opts.always_print_enums_as_ints = false;
  std::string out;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, opts);
  if (!status.ok()) return absl::InternalError(std::string(status.message()));
  if (out.empty() || out.back() != '\n') out.push_back('\n');
  return out;
}

namespace {

// The element size and .npy type of a value's dtype, after checking its shape
// and data size.
struct ValueType {
  int64_t bytes = 0;
  const char* descr = nullptr;  // nullptr: .npy has no such type
  HostScalar scalar = HostScalar::kF32;
};

absl::StatusOr<ValueType> CheckValue(const v1::TensorValue& value) {
  ValueType t;
  switch (value.dtype()) {
    case v1::DTYPE_F32: t = {4, "<f4", HostScalar::kF32}; break;
    case v1::DTYPE_F16: t = {2, "<f2", HostScalar::kF16}; break;
    case v1::DTYPE_BF16: t = {2, nullptr, HostScalar::kBF16}; break;
    case v1::DTYPE_I64: t = {8, "<i8", HostScalar::kI64}; break;
    case v1::DTYPE_I32: t = {4, "<i4", HostScalar::kI32}; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("value.dtype: unknown value ", value.dtype()));
  }
  for (int64_t d : value.shape()) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("value.shape: negative size ", d));
  }
  const std::optional<int64_t> want = CheckedBytes(value.shape(), t.bytes);
  if (!want.has_value()) return absl::InvalidArgumentError("value.shape: too large");
  if (static_cast<int64_t>(value.data().size()) != *want) {
    return absl::InvalidArgumentError(absl::StrCat("value.data: ", value.data().size(), " bytes, but shape [",
                                                   absl::StrJoin(value.shape(), ", "), "] needs ", *want));
  }
  return t;
}

}  // namespace

absl::StatusOr<std::vector<float>> TensorValueFloats(const v1::TensorValue& value) {
  ASSIGN_OR_RETURN(const ValueType t, CheckValue(value));
  const int64_t n = static_cast<int64_t>(value.data().size()) / t.bytes;
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = LoadAsFloat(value.data().data(), i, t.scalar);
  return out;
}

absl::StatusOr<std::string> TensorValueNpy(const v1::TensorValue& value) {
  ASSIGN_OR_RETURN(const ValueType t, CheckValue(value));
  if (t.descr == nullptr) return absl::InvalidArgumentError(".npy has no bf16; convert to f32 first");
  return NpyHeader(t.descr, value.shape()) + value.data();
}

std::string JobStateLabel(v1::JobState state) { return EnumSuffix(v1::JobState_Name(state), "JOB_STATE_"); }

std::string HumanBytes(int64_t n) {
  const double v = static_cast<double>(n);
  if (n >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", v / (1 << 30));
  if (n >= (1 << 20)) return absl::StrFormat("%.2f MiB", v / (1 << 20));
  if (n >= (1 << 10)) return absl::StrFormat("%.2f KiB", v / (1 << 10));
  return absl::StrCat(n, " B");
}

absl::StatusOr<std::string> RenderCheckpointsJson(const v1::Job& job, bool pretty) {
  std::vector<std::string> items;
  for (const v1::CheckpointInfo& c : job.checkpoints()) {
    ASSIGN_OR_RETURN(std::string one, RenderJson(c, /*pretty=*/false));
    while (!one.empty() && one.back() == '\n') one.pop_back();
    items.push_back(std::move(one));
  }
  if (!pretty) return absl::StrCat("{\"checkpoints\":[", absl::StrJoin(items, ","), "]}\n");
  if (items.empty()) return std::string("{\n \"checkpoints\": []\n}\n");
  return absl::StrCat("{\n \"checkpoints\": [\n  ", absl::StrJoin(items, ",\n  "), "\n ]\n}\n");
}

std::string RenderCheckpoints(const v1::Job& j) {
  std::vector<std::vector<std::string>> rows;
  const int n = j.checkpoints_size();
  std::optional<int> best;
  for (int i = 0; i < n; ++i) {
    const v1::CheckpointInfo& c = j.checkpoints(i);
    if (c.has_eval_loss() && !std::isnan(c.eval_loss()) &&
        (!best.has_value() || c.eval_loss() < j.checkpoints(*best).eval_loss())) {
      best = i;
    }
  }
  for (int i = 0; i < n; ++i) {
    const v1::CheckpointInfo& c = j.checkpoints(i);
    std::vector<std::string> notes;
    if (best == i) notes.push_back("best");
    if (i + 1 == n) notes.push_back("latest (a restart resumes here)");
    rows.push_back({absl::StrCat(c.step()), c.has_eval_loss() ? absl::StrFormat("%.6f", c.eval_loss()) : "-",
                    HumanBytes(c.bytes()), c.path(), absl::StrJoin(notes, ", ")});
  }
  return RenderTable({"STEP", "EVAL LOSS", "SIZE", "PATH", ""}, rows);
}

std::string LossScaleSuffix(const v1::StepProgress& p) {
  if (!p.has_loss_scale()) return "";
  return absl::StrFormat("  loss_scale %.0f%s", p.loss_scale(), p.update_skipped() ? " (overflowed: no update)" : "");
}

std::string EvalSummary(const v1::EvalResult& e) {
  std::string out = absl::StrFormat("loss %.6f", e.loss());
  if (e.has_perplexity()) absl::StrAppend(&out, absl::StrFormat("  perplexity %.4g", e.perplexity()));
  if (e.has_accuracy()) absl::StrAppend(&out, absl::StrFormat("  accuracy %.2f%%", 100 * e.accuracy()));
  absl::StrAppend(&out, "  after step ", e.step());
  if (!e.checkpoint().empty()) absl::StrAppend(&out, "  (", e.checkpoint(), ")");
  return out;
}

std::string RenderJobsTable(const std::vector<v1::Job>& jobs, absl::Time now) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Job& j : jobs) {
    const bool trained = j.step() > 0;
    rows.push_back({j.job_id(), j.spec().name().empty() ? "-" : j.spec().name(),
                    EnumSuffix(v1::JobKind_Name(j.spec().kind()), "JOB_KIND_"), JobStateLabel(j.state()),
                    LayoutName(j.spec().shard()),
                    trained ? absl::StrCat(j.step(), "/", j.spec().train().steps()) : "-",
                    trained ? absl::StrFormat("%.4f", j.loss()) : "-", Age(j.update_time(), now), j.reason()});
  }
  return RenderTable({"JOB", "NAME", "KIND", "STATE", "LAYOUT", "STEP", "LOSS", "UPDATED", "REASON"}, rows);
}

std::string RenderJob(const v1::Job& j, absl::Time now) {
  std::string out;
  absl::StrAppend(&out, "job:        ", j.job_id(), j.spec().name().empty() ? "" : absl::StrCat(" (", j.spec().name(), ")"),
                  "\n");
  absl::StrAppend(&out, "state:      ", JobStateLabel(j.state()), j.reason().empty() ? "" : absl::StrCat(": ", j.reason()),
                  "\n");
  absl::StrAppend(&out, "kind:       ", EnumSuffix(v1::JobKind_Name(j.spec().kind()), "JOB_KIND_"), "\n");
  absl::StrAppend(&out, "layout:     ", LayoutName(j.spec().shard()), "\n");
  if (j.spec().kind() == v1::JOB_KIND_TRAIN) {
    absl::StrAppend(&out, "step:       ", j.step(), "/", j.spec().train().steps(), "\n");
    if (j.step() > 0) absl::StrAppend(&out, "loss:       ", absl::StrFormat("%.6f", j.loss()), "\n");
    absl::StrAppend(&out, "data:       ", j.spec().train().data_path(), "\n");
    if (j.has_last_eval()) absl::StrAppend(&out, "eval:       ", EvalSummary(j.last_eval()), "\n");
    if (j.has_best_eval()) absl::StrAppend(&out, "best eval:  ", EvalSummary(j.best_eval()), "\n");
    if (j.has_summary()) {
      const v1::RunSummary& r = j.summary();
      absl::StrAppend(
          &out, "run:        ", r.steps(), " steps",
          r.skipped_updates() > 0 ? absl::StrCat(" (", r.skipped_updates(), " overflowed in fp16 and updated nothing)")
                                  : "",
          ", ", r.tokens(), " tokens in ",
          absl::FormatDuration(absl::Trunc(FromProtoDuration(r.train_time()), absl::Milliseconds(1))),
          " of steps (wall ",
          absl::FormatDuration(absl::Trunc(FromProtoDuration(r.wall_time()), absl::Milliseconds(1))),
          absl::StrFormat("); %.0f tokens/s mean, %.0f last", r.mean_tokens_per_second(), r.last_tokens_per_second()),
          "\n");
      if (r.mfu() > 0) {
        absl::StrAppend(&out, absl::StrFormat("mfu:        %.2f%% (%.3g model FLOPs a token; peak %.4g TFLOP/s)\n",
                                              100 * r.mfu(), r.model_flops_per_token(),
                                              r.peak_flops_per_second() / 1e12));
      } else if (r.steps() > 0) {
        absl::StrAppend(&out, "mfu:        unknown (",
                        r.model_flops_per_token() == 0    ? "no FLOPs per token for this model"
                        : r.peak_flops_per_second() == 0 ? "a device's peak is not known: colod-worker --peak-tflops"
                                                          : "no step time yet",
                        ")\n");
      }
    }
  }
  // An uploaded model (submit's default) has no path of its own: its upload.
  absl::StrAppend(&out, "weights:    ",
                  j.spec().model().upload_id().empty() ? j.spec().model().weights_path()
                                                       : absl::StrCat("upload ", j.spec().model().upload_id()),
                  "\n");
  if (!j.last_checkpoint().empty()) absl::StrAppend(&out, "checkpoint: ", j.last_checkpoint(), "\n");
  absl::StrAppend(&out, "generation: ", j.generation(), "\n");
  if (!j.stalled().empty()) {
    // Its durations are as of the report; once the job ended it is history.
    const bool ended = j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
                       j.state() == v1::JOB_STATE_CANCELLED;
    absl::StrAppend(&out, ended ? "last hang:  " : "stalled:    ", j.stalled(),
                    j.has_stalled_time() ? absl::StrCat(" (reported ", Age(j.stalled_time(), now), ")") : "", "\n");
  }
  if (j.restarts() > 0) {
    absl::StrAppend(&out, "restarts:   ", j.restarts(), "\n");
    for (int i = 0; i < j.attempt_failures_size(); ++i) {
      absl::StrAppend(&out, "  attempt ", i + 1, ": ", j.attempt_failures(i), "\n");
    }
  }
  absl::StrAppend(&out, "created:    ", Age(j.create_time(), now), "\n");
  absl::StrAppend(&out, "updated:    ", Age(j.update_time(), now), "\n");
  return out;
}

std::string RenderMesh(const v1::MeshSpec& mesh) {
  std::string out;
  std::vector<std::string> axes;
  for (const v1::MeshAxis& a : mesh.axes()) axes.push_back(absl::StrCat(a.name(), "=", a.size()));
  absl::StrAppend(&out, mesh.world_size(), " ranks, axes ", absl::StrJoin(axes, " x "), " (outermost first)\n\n");
  // The grid of the ColoTensor document's figure: a row per dp replica (the
  // outer axes; with pipeline stages, a row per stage of each replica), a
  // column per tp rank (the innermost axes, neighbours on one host).
  int tp = 1, pp = 1;
  for (const v1::MeshAxis& a : mesh.axes()) {
    if (absl::StartsWith(a.name(), "tp")) tp *= a.size();
    if (a.name() == "pp") pp = a.size();
  }
  if (tp < 1 || mesh.world_size() % tp != 0) tp = mesh.world_size();
  if (pp < 1 || (mesh.world_size() / tp) % pp != 0) pp = 1;
  std::vector<std::string> header = {""};
  for (int c = 0; c < tp; ++c) header.push_back(absl::StrCat("tp", c));
  std::vector<std::vector<std::string>> rows;
  for (int r = 0; r < mesh.world_size() / tp; ++r) {
    std::vector<std::string> row = {pp > 1 ? absl::StrCat("dp", r / pp, " pp", r % pp) : absl::StrCat("dp", r)};
    for (int c = 0; c < tp; ++c) {
      const int rank = r * tp + c;
      std::string cell = absl::StrCat("rank ", rank);
      if (rank < mesh.ranks_size()) {
        const v1::RankAssignment& a = mesh.ranks(rank);
        absl::StrAppend(&cell, " ", a.worker_id(), "@", a.host(), ":", a.device_ordinal());
      }
      row.push_back(cell);
    }
    rows.push_back(row);
  }
  absl::StrAppend(&out, RenderTable(header, rows), "\ngroups:\n");
  for (const v1::ProcessGroupSpec& g : mesh.groups()) {
    absl::StrAppend(&out, "  ", g.axis(), g.index(), ": {", absl::StrJoin(g.ranks(), ","), "}\n");
  }
  return out;
}

std::string Sparkline(const std::vector<double>& values, size_t width) {
  static const char* const kBlocks[] = {"\u2581", "\u2582", "\u2583", "\u2584",
                                        "\u2585", "\u2586", "\u2587", "\u2588"};
  if (values.empty() || width == 0) return "";
  const size_t n = std::min(values.size(), width);
  std::vector<double> buckets(n, 0.0);
  for (size_t b = 0; b < n; ++b) {
    const size_t lo = b * values.size() / n, hi = (b + 1) * values.size() / n;
    for (size_t i = lo; i < hi; ++i) buckets[b] += values[i];
    buckets[b] /= static_cast<double>(hi - lo);
  }
  // A diverged run's NaN or infinite loss is a '!', and scales nothing.
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double v : buckets) {
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const double half_span = hi * 0.5 - lo * 0.5;  // halves: finite for any finite hi and lo
  std::string out;
  for (double v : buckets) {
    if (!std::isfinite(v)) {
      out += "!";
      continue;
    }
    const int level =
        half_span > 0 ? std::clamp(static_cast<int>((v * 0.5 - lo * 0.5) / half_span * 7.0 + 0.5), 0, 7) : 0;
    out += kBlocks[level];
  }
  return out;
}

std::string RenderRunCurves(std::vector<StepPoint> losses, double tokens_per_second_sum,
                            std::vector<StepPoint> evals) {
  const auto by_step = [](const StepPoint& a, const StepPoint& b) { return a.step < b.step; };
  const auto values = [](const std::vector<StepPoint>& points) {
    std::vector<double> v;
    v.reserve(points.size());
    for (const StepPoint& p : points) v.push_back(p.value);
    return v;
  };
  std::stable_sort(losses.begin(), losses.end(), by_step);
  std::stable_sort(evals.begin(), evals.end(), by_step);
  std::string out;
  if (!losses.empty()) {
    const std::vector<double> v = values(losses);
    absl::StrAppendFormat(&out, "loss %.4f -> %.4f over %zu steps (min %.4f), mean %.0f tokens/s\n", v.front(),
                          v.back(), v.size(), *std::min_element(v.begin(), v.end()),
                          tokens_per_second_sum / static_cast<double>(v.size()));
    absl::StrAppend(&out, "loss curve ", Sparkline(v, 60), "\n");
  }
  if (evals.size() > 1) absl::StrAppend(&out, "eval curve ", Sparkline(values(evals), 60), "\n");
  return out;
}

absl::StatusOr<v1::DistSpec> ParseDistSpecText(const std::string& text, const v1::MeshSpec& mesh) {
  v1::DistSpec spec;
  const std::string trimmed(absl::StripAsciiWhitespace(text));
  if (trimmed.empty() || trimmed == "R") return spec;
  for (absl::string_view part : absl::StrSplit(trimmed, ';', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    const size_t eq = part.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("spec '", part, "': expected AXIS=R, AXIS=S(DIM) or AXIS=P"));
    }
    const std::string axis(absl::StripAsciiWhitespace(part.substr(0, eq)));
    const std::string what(absl::StripAsciiWhitespace(part.substr(eq + 1)));
    int size = 0;
    for (const v1::MeshAxis& a : mesh.axes()) {
      if (a.name() == axis) size = a.size();
    }
    if (size == 0) {
      std::vector<std::string> names;
      for (const v1::MeshAxis& a : mesh.axes()) names.push_back(a.name());
      return absl::InvalidArgumentError(
          absl::StrCat("spec '", part, "': the mesh has no axis '", axis, "' (axes: ", absl::StrJoin(names, ", "), ")"));
    }
    v1::AxisPlacement& ap = *spec.add_placements();
    ap.set_axis(axis);
    if (what == "R") {
      ap.mutable_placement()->mutable_replicate();
    } else if (what == "P") {
      ap.mutable_placement()->mutable_partial()->set_op(v1::REDUCE_OP_SUM);
    } else if (absl::StartsWith(what, "S(") && absl::EndsWith(what, ")")) {
      const std::string inner = what.substr(2, what.size() - 3);
      const std::vector<std::string> halves = absl::StrSplit(inner, '|');
      v1::Shard& shard = *ap.mutable_placement()->mutable_shard();
      for (absl::string_view d : absl::StrSplit(halves[0], ',')) {
        int v;
        if (!absl::SimpleAtoi(d, &v)) return absl::InvalidArgumentError(absl::StrCat("spec '", part, "': bad dim '", d, "'"));
        shard.add_dims(v);
      }
      if (halves.size() == 1 && shard.dims_size() == 1) {
        shard.add_num_partitions(size);
      } else if (halves.size() == 2) {
        for (absl::string_view n : absl::StrSplit(halves[1], ',')) {
          int v;
          if (!absl::SimpleAtoi(n, &v)) {
            return absl::InvalidArgumentError(absl::StrCat("spec '", part, "': bad partition count '", n, "'"));
          }
          shard.add_num_partitions(v);
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("spec '", part, "': several dims need their partitions: S(D1,D2|N1,N2)"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("spec '", part, "': '", what, "' is not R, S(...) or P"));
    }
  }
  return spec;
}

std::string DistSpecText(const v1::DistSpec& spec) {
  std::vector<std::string> parts;
  for (const v1::AxisPlacement& ap : spec.placements()) {
    const v1::Placement& p = ap.placement();
    if (p.has_shard()) {
      parts.push_back(absl::StrCat(ap.axis(), "=S(", absl::StrJoin(p.shard().dims(), ","), "|",
                                   absl::StrJoin(p.shard().num_partitions(), ","), ")"));
    } else if (p.has_partial()) {
      parts.push_back(absl::StrCat(ap.axis(), "=P"));
    }
  }
  return parts.empty() ? "R" : absl::StrJoin(parts, ";");
}

std::string RenderTensorLayout(const v1::TensorLayout& layout) {
  std::string out = absl::StrCat(layout.name(), ": ", EnumSuffix(v1::DType_Name(layout.dtype()), "DTYPE_"), " [",
                                 absl::StrJoin(layout.global_shape(), ", "), "], spec ",
                                 DistSpecText(layout.dist_spec()), "\n");
  std::vector<std::vector<std::string>> rows;
  for (const v1::ShardLayout& s : layout.shards()) {
    rows.push_back({absl::StrCat(s.rank()), absl::StrCat("[", absl::StrJoin(s.shape(), ", "), "]"),
                    absl::StrCat("[", absl::StrJoin(s.offsets(), ", "), "]"), s.partial() ? "partial" : ""});
  }
  absl::StrAppend(&out, RenderTable({"  RANK", "SHAPE", "OFFSETS", ""}, [&] {
                    for (auto& r : rows) r[0] = "  " + r[0];
                    return rows;
                  }()));
  return out;
}

}  // namespace colod
