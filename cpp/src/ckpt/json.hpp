// Internal: JSON reading and writing for the checkpoint files that hold
// JSON (safetensors headers, stripe owner files, checkpoint indexes).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "ebbtide/ckpt/format.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::ckpt::detail {

// A strict reader of JSON text read from a file (hostile input): RFC 8259
// syntax, UTF-8 strings (escapes decoded, unpaired surrogates refused),
// non-negative integers without fraction or exponent where a format wants
// sizes, and a nesting limit for values it skips. Errors are InvalidArgument
// "<path>: <kind> (<what> at byte <n> of the file)", the text starting at
// byte `offset` of the file. Keeps references to `path` and `kind`.
class Json {
 public:
  Json(std::string_view text, const std::string& path, std::string_view kind, uint64_t offset = 0)
      : s_(text), path_(path), kind_(kind), offset_(offset) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(ebbtide::detail::concat(path_, ": ", kind_, " (", what, " at byte ", pos_ + offset_,
                                                  " of the file)"));
  }
  void ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool next_is(char c) {
    ws();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c, std::string_view where) {
    if (!next_is(c)) fail(ebbtide::detail::concat("expected '", c, "' ", where));
    ++pos_;
  }
  // After an object member or array element: true for ',' (more follow), false for `close`.
  bool more(char close, std::string_view where) {
    ws();
    if (pos_ < s_.size() && s_[pos_] == ',') {
      ++pos_;
      return true;
    }
    expect(close, where);
    return false;
  }
  bool at_end() {
    ws();
    return pos_ == s_.size();
  }

  std::string string(std::string_view what) {
    if (!next_is('"')) fail(ebbtide::detail::concat("expected a string for ", what));
    ++pos_;
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail(ebbtide::detail::concat("unterminated string in ", what));
      auto c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') break;
      if (c < 0x20) fail(ebbtide::detail::concat("control character in ", what));
      if (c != '\\') {
        out.push_back(static_cast<char>(c));
        continue;
      }
      if (pos_ >= s_.size()) fail(ebbtide::detail::concat("unterminated string in ", what));
      char e = s_[pos_++];
      switch (e) {
        case '"': case '\\': case '/': out.push_back(e); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = hex4(what);
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail(ebbtide::detail::concat("unpaired surrogate escape in ", what));
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (pos_ + 2 > s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              fail(ebbtide::detail::concat("unpaired surrogate escape in ", what));
            pos_ += 2;
            uint32_t lo = hex4(what);
            if (lo < 0xDC00 || lo > 0xDFFF) fail(ebbtide::detail::concat("unpaired surrogate escape in ", what));
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(ebbtide::detail::concat("invalid escape '\\", e, "' in ", what));
      }
    }
    if (!valid_utf8(out)) fail(ebbtide::detail::concat(what, " is not valid UTF-8"));
    return out;
  }

  uint64_t uint(std::string_view what) {
    ws();
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9')
      fail(ebbtide::detail::concat(what, " is not a non-negative integer"));
    if (s_[pos_] == '0' && pos_ + 1 < s_.size() && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9')
      fail(ebbtide::detail::concat(what, " has a leading zero"));
    uint64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      uint64_t d = static_cast<uint64_t>(s_[pos_] - '0');
      if (v > (UINT64_MAX - d) / 10) fail(ebbtide::detail::concat(what, " does not fit in 64 bits"));
      v = v * 10 + d;
      ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail(ebbtide::detail::concat(what, " is not an integer"));
    return v;
  }

  // Skips one value of any type (members the format does not define).
  void skip_value(int depth) {
    if (depth > 64) fail("values nested more than 64 deep");
    ws();
    if (pos_ >= s_.size()) fail("unexpected end of the header");
    char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      if (next_is('}')) {
        ++pos_;
        return;
      }
      do {
        string("a member name");
        expect(':', "after a member name");
        skip_value(depth + 1);
      } while (more('}', "after an object member"));
    } else if (c == '[') {
      ++pos_;
      if (next_is(']')) {
        ++pos_;
        return;
      }
      do {
        skip_value(depth + 1);
      } while (more(']', "after an array element"));
    } else if (c == '"') {
      string("a string value");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      number();
    } else if (!literal("true") && !literal("false") && !literal("null")) {
      fail(ebbtide::detail::concat("unexpected character '", printable(c), "'"));
    }
  }

  bool literal(std::string_view word) {
    ws();
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

 private:
  static std::string printable(char c) {
    auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string(1, c);
    char b[8];
    std::snprintf(b, sizeof b, "\\x%02x", u);
    return b;
  }
  uint32_t hex4(std::string_view what) {
    if (pos_ + 4 > s_.size()) fail(ebbtide::detail::concat("truncated \\u escape in ", what));
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<uint32_t>(h - 'A' + 10);
      else fail(ebbtide::detail::concat("invalid \\u escape in ", what));
    }
    return v;
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  void digits() {
    size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    if (pos_ == start) fail("malformed number");
  }
  void number() {
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') ++pos_;
    else digits();
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits();
    }
  }

  std::string_view s_;
  const std::string& path_;
  std::string_view kind_;
  uint64_t offset_;
  size_t pos_ = 0;
};

// `s` as a JSON string literal (quotes, backslashes and control characters escaped).
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(ch);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out.push_back(ch);
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace ebbtide::ckpt::detail
