// safetensors files: header parsing and validation (Note [Hostile
// safetensors]) and encoding. Reads (Note [Reading in place]) are in
// safetensors_read.cpp, writes (Note [Safetensors save]) in
// safetensors_save.cpp, both through the I/O path (io::TransferLoop).
#include "ebbtide/ckpt/safetensors.hpp"

#include <algorithm>
#include <numeric>
#include <unordered_set>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"
#include "json.hpp"
#include "safetensors_impl.hpp"

namespace ebbtide::ckpt::safetensors {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the safetensors header length is little-endian");

using detail::Json;
using detail::json_string;

namespace {

struct DtypeBits {
  std::string_view name;
  uint32_t bits;
};
// Every dtype of the format (the safetensors package 0.8).
constexpr DtypeBits kDtypes[] = {
    {"BOOL", 8},         {"F4", 4},           {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},   {"I8", 8},
    {"F8_E5M2", 8},      {"F8_E4M3", 8},      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},         {"F8_E5M2FNUZ", 8},
    {"I16", 16},         {"U16", 16},         {"F16", 16},    {"BF16", 16},   {"I32", 32}, {"U32", 32},
    {"F32", 32},         {"C64", 64},         {"F64", 64},    {"I64", 64},    {"U64", 64},
};

TensorInfo parse_tensor(Json& j, std::string name) {
  TensorInfo t;
  t.name = std::move(name);
  const std::string who = "tensor " + quoted(t.name);
  bool have_dtype = false, have_shape = false, have_offsets = false;
  j.expect('{', "to open the entry of " + who);
  if (j.next_is('}')) {
    j.expect('}', "");
  } else {
    do {
      std::string key = j.string("a member name of " + who);
      j.expect(':', "after a member name of " + who);
      auto once = [&](bool& seen) {
        if (seen) j.fail(ebbtide::detail::concat(who, " has '", key, "' twice"));
        seen = true;
      };
      if (key == "dtype") {
        once(have_dtype);
        t.dtype = j.string("the dtype of " + who);
      } else if (key == "shape") {
        once(have_shape);
        j.expect('[', "to open the shape of " + who);
        if (j.next_is(']')) {
          j.expect(']', "");
        } else {
          do {
            if (t.shape.size() == kMaxDims)
              j.fail(ebbtide::detail::concat("the shape of ", who, " has more than ", kMaxDims, " dimensions"));
            t.shape.push_back(j.uint("a dimension of " + who));
          } while (j.more(']', "in the shape of " + who));
        }
      } else if (key == "data_offsets") {
        once(have_offsets);
        j.expect('[', "to open the data_offsets of " + who);
        t.begin = j.uint("the first data offset of " + who);
        j.expect(',', "in the data_offsets of " + who + " (two offsets)");
        t.end = j.uint("the second data offset of " + who);
        j.expect(']', "after the two data_offsets of " + who);
      } else {
        j.skip_value(1);  // a member the format does not define: ignored, as the safetensors package does
      }
    } while (j.more('}', "after a member of " + who));
  }
  if (!have_dtype || !have_shape || !have_offsets)
    j.fail(ebbtide::detail::concat(who, " has no '", !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets",
                                   "'"));
  return t;
}

void parse_metadata(Json& j, Metadata& out) {
  if (j.literal("null")) return;
  j.expect('{', "to open __metadata__ (a map of strings)");
  if (j.next_is('}')) {
    j.expect('}', "");
    return;
  }
  std::unordered_set<std::string> keys;
  do {
    std::string k = j.string("a __metadata__ key");
    j.expect(':', "after a __metadata__ key");
    if (!j.next_is('"')) j.fail("the __metadata__ value of " + quoted(k) + " is not a string");
    std::string v = j.string("the __metadata__ value of " + quoted(k));
    if (!keys.insert(k).second) j.fail("__metadata__ has the key " + quoted(k) + " twice");
    out.emplace_back(std::move(k), std::move(v));
  } while (j.more('}', "after a __metadata__ entry"));
}

}  // namespace

uint32_t dtype_bits(std::string_view dtype) {
  for (const auto& d : kDtypes)
    if (d.name == dtype) return d.bits;
  return 0;
}

// Note [Hostile safetensors]
// A safetensors file may come from anyone; nothing in it is trusted. The
// header length must leave the 8 length bytes and the header inside the file
// and be at most kMaxHeaderBytes (checked by Reader before reading it). The
// header must be one well-formed JSON object (Json above: strict syntax,
// UTF-8, no unpaired surrogates, skipped values at most 64 deep); its members
// are tensors, names unique, plus at most one "__metadata__" map of strings.
// Each tensor has a known dtype, at most kMaxDims dimensions and integer
// offsets begin <= end; shape x dtype bits, computed in 128 bits, is a whole
// number of bytes equal to end - begin. Sorted by offset, the tensors tile
// the data section exactly, as the format requires: the first starts at 0,
// each starts where the previous ends (no gap, no overlap), the last ends at
// the end of the file. So every read lies inside the file and writes only its
// own target's bytes, and destination memory (sized by the header) is
// bounded by the file size.
Header parse_header(std::string_view json, uint64_t file_bytes, const std::string& path) {
  auto bad = [&](auto&&... what) {
    return InvalidArgument(ebbtide::detail::concat(path, ": invalid safetensors file (", what..., ")"));
  };
  if (json.size() > kMaxHeaderBytes || !fits_within(8, json.size(), file_bytes))
    throw bad("header length ", json.size(), " does not fit in the file of ", file_bytes, " bytes");
  Header h;
  h.data_offset = 8 + json.size();
  h.data_bytes = file_bytes - h.data_offset;
  Json j(json, path, "invalid safetensors header", 8);
  j.expect('{', "at the start of the header");
  std::unordered_set<std::string> names;
  bool have_meta = false;
  if (j.next_is('}')) {
    j.expect('}', "");
  } else {
    do {
      std::string key = j.string("a tensor name");
      j.expect(':', "after the name " + quoted(key));
      if (key == "__metadata__") {
        if (have_meta) j.fail("__metadata__ appears twice");
        have_meta = true;
        parse_metadata(j, h.metadata);
        continue;
      }
      if (!names.insert(key).second) j.fail("tensor " + quoted(key) + " appears twice");
      h.tensors.push_back(parse_tensor(j, std::move(key)));
    } while (j.more('}', "after a header entry"));
  }
  if (!j.at_end()) j.fail("text after the header object");

  for (const auto& t : h.tensors) {
    const std::string who = "tensor " + quoted(t.name);
    uint32_t bits = dtype_bits(t.dtype);
    if (bits == 0) throw bad(who, ": unknown dtype ", quoted(t.dtype));
    if (t.begin > t.end) throw bad(who, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
    if (t.end > h.data_bytes)
      throw bad(who, ": data_offsets [", t.begin, ", ", t.end, "] run past the data section (", h.data_bytes,
                " bytes)");
    uint64_t n = 0;
    if (!tensor_bytes(t.shape, bits, &n) || n != t.end - t.begin) {
      std::string dims;
      for (auto d : t.shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
      throw bad(who, ": shape [", dims, "] of ", t.dtype, " does not take the ", t.end - t.begin,
                " bytes of its data_offsets [", t.begin, ", ", t.end, "]");
    }
  }
  std::vector<size_t> order(h.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto &x = h.tensors[a], &y = h.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t covered = 0;  // data bytes [0, covered) belong to a tensor
  const TensorInfo* prev = nullptr;
  for (size_t i : order) {
    const auto& t = h.tensors[i];
    if (t.begin < covered)
      throw bad("tensor ", quoted(t.name), " at data bytes [", t.begin, ", ", t.end, ") overlaps tensor ",
                quoted(prev->name), " at [", prev->begin, ", ", prev->end, ")");
    if (t.begin > covered)
      throw bad("data bytes [", covered, ", ", t.begin, ") belong to no tensor (before tensor ", quoted(t.name), ")");
    covered = t.end;
    prev = &t;
  }
  if (covered != h.data_bytes)
    throw bad("data bytes [", covered, ", ", h.data_bytes, ") at the end of the file belong to no tensor");
  return h;
}

std::string encode_header(const std::vector<TensorInfo>& tensors, const Metadata& metadata) {
  std::string s = "{";
  if (!metadata.empty()) {
    s += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) s += ',';
      s += json_string(metadata[i].first) + ':' + json_string(metadata[i].second);
    }
    s += "}";
  }
  for (const auto& t : tensors) {
    if (s.size() > 1) s += ',';
    s += json_string(t.name) + ":{\"dtype\":" + json_string(t.dtype) + ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(t.shape[i]);
    }
    s += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
  }
  s += '}';
  s.append((8 - (8 + s.size()) % 8) % 8, ' ');
  return s;
}

IoOptions IoOptions::from_env() {
  WriterOptions w = WriterOptions{}.with_env();
  IoOptions o;
  o.direct = w.direct;
  o.backend = w.backend;
  o.queue_depth = w.queue_depth;
  return o;
}

}  // namespace ebbtide::ckpt::safetensors
