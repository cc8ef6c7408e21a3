// Note [Stripe ownership]
// A stripe directory is named <basename>.stripe-<tag>-<id>, the tag a hash of
// the checkpoint's absolute path (stripe_path_tag), and holds owner.json
// naming that path and the id. The next save of the path removes every such
// directory its committed record does not name. The name alone marks it as
// this path's, so a save killed between creating the directory and making
// owner.json durable leaves nothing behind either; owner.json guards against
// a tag collision (a different owner is left alone) and identifies
// directories of older, untagged names (<basename>.stripe-<id>).
// The committed record (index.json, or the DCP plugin's stripe record) is
// not trusted to say what is ours: anyone may have edited it. A directory it
// lists is removed (or its parent searched for stale ones) only when
// owned_stripe_dir proves it belongs to this path and that checkpoint: an
// absolute, normalised path, a real directory (not a symlink) named
// <basename>.stripe-[<tag>-]<id> with the record's id, whose owner.json (a
// regular file) names this path and that id. Nothing that is not a
// directory is ever removed, and symlinks are never followed.
#include "ebbtide/ckpt/transaction.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <set>

#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"
#include "json.hpp"

namespace ebbtide::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxRecordBytes = 64u << 20;  // index.json and owner.json are small; a bigger one is not ours

// SHA-1 (FIPS 180-4) of `data`, for stripe_path_tag only (not a security
// boundary: owner.json settles ownership).
std::array<uint8_t, 20> sha1(const std::string& data) {
  uint32_t h[5] = {0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0};
  std::string m = data;
  const uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  m.push_back(static_cast<char>(0x80));
  while (m.size() % 64 != 56) m.push_back('\0');
  for (int i = 7; i >= 0; --i) m.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
  auto rol = [](uint32_t x, int n) { return (x << n) | (x >> (32 - n)); };
  for (size_t off = 0; off < m.size(); off += 64) {
    uint32_t w[80];
    for (int i = 0; i < 16; ++i) {
      const auto* p = reinterpret_cast<const unsigned char*>(m.data() + off + 4 * i);
      w[i] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
    }
    for (int i = 16; i < 80; ++i) w[i] = rol(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
    for (int i = 0; i < 80; ++i) {
      uint32_t f, k;
      if (i < 20) f = (b & c) | (~b & d), k = 0x5A827999;
      else if (i < 40) f = b ^ c ^ d, k = 0x6ED9EBA1;
      else if (i < 60) f = (b & c) | (b & d) | (c & d), k = 0x8F1BBCDC;
      else f = b ^ c ^ d, k = 0xCA62C1D6;
      uint32_t t = rol(a, 5) + f + e + k + w[i];
      e = d, d = c, c = rol(b, 30), b = a, a = t;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e;
  }
  std::array<uint8_t, 20> out{};
  for (int i = 0; i < 20; ++i) out[i] = static_cast<uint8_t>(h[i / 4] >> (24 - 8 * (i % 4)));
  return out;
}

bool is_hex(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string base_name(const std::string& path) { return fs::path(path).filename().string(); }

// The directory holding `path`, an absolute path (never empty: "/" at worst).
std::string parent_dir(const std::string& path) { return fs::path(path).parent_path().string(); }

// `p` made absolute and normalised lexically, without a trailing slash
// (os.path.abspath).
std::string normal_absolute(const std::string& p) {
  std::string s = fs::absolute(p).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// A real directory, not a symlink to one.
bool is_real_dir(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The contents of `path` if it is a regular file of at most kMaxRecordBytes
// (opened without following a symlink or blocking on a FIFO).
std::optional<std::string> read_record_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::optional<std::string> out;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) <= kMaxRecordBytes) {
    std::string s;
    char buf[1 << 16];
    for (;;) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) out = std::move(s);
        break;
      }
      s.append(buf, static_cast<size_t>(n));
      if (s.size() > kMaxRecordBytes) break;
    }
  }
  ::close(fd);
  return out;
}

// Reads the JSON object in file `path`, calling on_member(name, json) to
// consume each member's value. False when the file is not a regular file
// holding one well-formed JSON object (or on_member returns false).
template <class OnMember>
bool read_json_object(const std::string& path, OnMember on_member) {
  auto text = read_record_file(path);
  if (!text) return false;
  try {
    detail::Json j(*text, path, "invalid JSON");
    j.expect('{', "at the start");
    if (j.next_is('}')) {
      j.expect('}', "");
    } else {
      do {
        std::string key = j.string("a member name");
        j.expect(':', "after a member name");
        if (!on_member(key, j)) return false;
      } while (j.more('}', "after an object member"));
    }
    return j.at_end();
  } catch (const InvalidArgument&) {
    return false;
  }
}

// A JSON member value as ownership checks see it (a member given twice counts
// as its last value, as with Python's json).
struct JsonField {
  bool present = false;  // neither absent nor null
  std::optional<std::string> text;
};

JsonField read_field(detail::Json& j, std::string_view what) {
  JsonField f;
  if (j.next_is('"')) {
    f.present = true;
    f.text = j.string(what);
  } else if (!j.literal("null")) {
    f.present = true;
    j.skip_value(0);
  }
  return f;
}

struct Owner {
  JsonField checkpoint, id;
};

// The owner file of stripe directory `dir`; fields absent when it is missing,
// not a regular file or not a JSON object.
Owner read_owner(const std::string& dir) {
  Owner o;
  bool ok = read_json_object(dir + "/" + kStripeOwnerName, [&](const std::string& key, detail::Json& j) {
    if (key == "checkpoint") o.checkpoint = read_field(j, key);
    else if (key == "id") o.id = read_field(j, key);
    else j.skip_value(0);
    return true;
  });
  return ok ? o : Owner{};
}

// The committed checkpoint's id and stripe directories as its record lists
// them (checked for their types only), or nullopt without a usable record.
struct Record {
  std::string id;
  std::vector<std::string> stripes;
};
std::optional<Record> read_record(const std::string& file) {
  Record r;
  JsonField id;
  bool ok = read_json_object(file, [&](const std::string& key, detail::Json& j) {
    if (key == "id") {
      id = read_field(j, key);
    } else if (key == "stripes") {
      r.stripes.clear();
      if (!j.next_is('[')) return false;
      j.expect('[', "");
      if (j.next_is(']')) {
        j.expect(']', "");
      } else {
        do {
          if (!j.next_is('"')) return false;
          r.stripes.push_back(j.string("a stripes entry"));
        } while (j.more(']', "after a stripes entry"));
      }
    } else {
      j.skip_value(0);
    }
    return true;
  });
  if (!ok || !id.text || id.text->empty() || id.text->size() > 64 || !is_hex(*id.text) ||
      r.stripes.size() > kMaxStripeDirs)
    return std::nullopt;
  r.id = *id.text;
  return r;
}

std::string new_checkpoint_id() {
  std::random_device rd;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char b[9];
    std::snprintf(b, sizeof b, "%08x", static_cast<unsigned>(rd()));
    id += b;
  }
  return id;
}

std::vector<std::string> check_stripe_dirs(const std::vector<std::string>& dirs, const std::string& path) {
  std::vector<std::string> out;
  for (const auto& given : dirs) {
    EBB_CHECK(!given.empty() && given.find('\0') == std::string::npos, "checkpoint.save: stripe directory '",
              given.substr(0, 120), "' is not a path");
    std::string d = normal_absolute(given);
    struct stat st {};
    EBB_CHECK(::stat(d.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "checkpoint.save: stripe directory ", d,
              " does not exist (or is not a directory)");
    EBB_CHECK(std::find(out.begin(), out.end(), d) == out.end(), "checkpoint.save: stripe directory ", d,
              " is listed twice");
    EBB_CHECK(d != path && d.rfind(path + "/", 0) != 0, "checkpoint.save: stripe directory ", d,
              " lies inside the checkpoint ", path);
    out.push_back(d);
  }
  EBB_CHECK(out.size() <= kMaxStripeDirs, "checkpoint.save: ", out.size(), " stripe directories; at most ",
            kMaxStripeDirs);
  return out;
}

// Removes the stripe directories of `path` in `dirs` that are not in `keep`
// and are ours by name or owner file (Note [Stripe ownership]): left by a
// killed or failed save.
void remove_stale_stripes(const std::string& path, const std::set<std::string>& dirs,
                          const std::set<std::string>& keep) {
  const std::string prefix = base_name(path) + ".stripe-";
  const std::string tagged = prefix + stripe_path_tag(path) + "-";
  for (const auto& d : dirs) {
    std::vector<std::string> stale;
    std::error_code ec;
    for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {
      std::string name = it->path().filename().string();
      std::string full = d + "/" + name;
      if (name.rfind(prefix, 0) != 0 || keep.count(full) || !is_real_dir(full)) continue;
      Owner o = read_owner(full);  // absent or half-written: a save killed while creating it
      if ((o.checkpoint.text && *o.checkpoint.text == path) ||
          (!o.checkpoint.present && name.rfind(tagged, 0) == 0))
        stale.push_back(full);
    }
    for (const auto& s : stale) fs::remove_all(s, ec);
  }
}

}  // namespace

std::string stripe_path_tag(const std::string& path) {
  auto h = sha1(path);
  char b[9];
  std::snprintf(b, sizeof b, "%02x%02x%02x%02x", h[0], h[1], h[2], h[3]);
  return b;
}

bool stripe_dir_matches(const std::string& dir, const std::string& id) {
  if (dir.size() < 2 || dir[0] != '/' || dir.find('\0') != std::string::npos || id.empty()) return false;
  size_t start = 1;
  for (;;) {  // normalised: no empty, "." or ".." component, no trailing slash
    size_t slash = dir.find('/', start);
    std::string_view comp = std::string_view(dir).substr(start, slash == std::string::npos ? slash : slash - start);
    if (comp.empty() || comp == "." || comp == "..") return false;
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  std::string_view base = std::string_view(dir).substr(dir.rfind('/') + 1);
  const std::string_view mark = ".stripe-";
  if (!ends_with(base, id)) return false;
  std::string_view rest = base.substr(0, base.size() - id.size());
  if (ends_with(rest, mark) && rest.size() > mark.size()) return true;  // <name>.stripe-<id>
  if (rest.size() < 9 || rest.back() != '-') return false;             // <name>.stripe-<tag>-<id>
  std::string_view tag = rest.substr(rest.size() - 9, 8);
  rest = rest.substr(0, rest.size() - 9);
  return is_hex(tag) && ends_with(rest, mark) && rest.size() > mark.size();
}

bool owned_stripe_dir(const std::string& dir, const std::string& path, const std::string& id) {
  if (!stripe_dir_matches(dir, id)) return false;
  const std::string base = base_name(dir), prefix = base_name(path) + ".stripe-";
  if (base != prefix + stripe_path_tag(path) + "-" + id && base != prefix + id) return false;
  if (!is_real_dir(dir)) return false;
  Owner o = read_owner(dir);
  return o.checkpoint.text == path && o.id.text == id;
}

SaveTransaction SaveTransaction::reserve(const std::string& path_in, const std::vector<std::string>& stripe_dirs,
                                         const std::string& record) {
  EBB_CHECK(!path_in.empty(), "checkpoint path is empty");
  SaveTransaction t;
  t.path_ = normal_absolute(path_in);
  std::vector<std::string> dirs = check_stripe_dirs(stripe_dirs, t.path_);
  const std::string parent = parent_dir(t.path_);
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) throw IoError(ec.value(), parent, -1, "cannot create the checkpoint's parent directory");

  {  // fail before writing a byte, not at the commit
    struct stat st {};
    if (::lstat(t.path_.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      throw IoError(EEXIST, t.path_, -1, "cannot save a checkpoint there: the path exists and is not a directory");
  }
  remove_stale_temps(t.path_);
  std::optional<Record> old;
  if (!record.empty()) old = read_record(t.path_ + "/" + record);
  if (old) {
    t.replaced_id_ = old->id;
    for (const auto& sd : old->stripes)
      if (owned_stripe_dir(sd, t.path_, old->id)) t.replaced_stripes_.push_back(sd);
  }
  if (!dirs.empty() || !t.replaced_stripes_.empty()) {
    std::set<std::string> scan(dirs.begin(), dirs.end());
    for (const auto& sd : t.replaced_stripes_) scan.insert(parent_dir(sd));
    std::set<std::string> keep;
    if (old) keep.insert(old->stripes.begin(), old->stripes.end());
    remove_stale_stripes(t.path_, scan, keep);
  }

  t.id_ = new_checkpoint_id();
  t.tmp_dir_ = make_temp_dir(t.path_);
  try {
    const std::string name = base_name(t.path_) + ".stripe-" + stripe_path_tag(t.path_) + "-" + t.id_;
    const std::string owner = "{\"checkpoint\": " + detail::json_string(t.path_) + ", \"id\": " +
                              detail::json_string(t.id_) + "}";
    for (const auto& d : dirs) {
      std::string sd = d + "/" + name;
      if (::mkdir(sd.c_str(), 0777) != 0) throw_io_error(errno, sd, -1, "mkdir (stripe directory)");
      t.stripes_.push_back(sd);
      write_file_durably(sd + "/" + kStripeOwnerName, owner);
    }
  } catch (...) {
    t.discard();
    throw;
  }
  return t;
}

void SaveTransaction::committed() noexcept {
  for (const auto& sd : replaced_stripes_) {
    if (std::find(stripes_.begin(), stripes_.end(), sd) != stripes_.end()) continue;
    if (!owned_stripe_dir(sd, path_, replaced_id_)) continue;  // changed since reserve(): no longer provably ours
    std::error_code ec;
    fs::remove_all(sd, ec);
  }
  replaced_stripes_.clear();
}

void SaveTransaction::discard() noexcept {
  std::error_code ec;
  if (!tmp_dir_.empty()) fs::remove_all(tmp_dir_, ec);
  for (const auto& sd : stripes_) fs::remove_all(sd, ec);
}

}  // namespace ebbtide::ckpt
