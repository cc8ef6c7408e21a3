// The directories of one checkpoint save and the protocol that keeps them
// crash-safe and confined (Note [Commit by rename] in commit.cpp, Note
// [Stripe ownership] in transaction.cpp): reserve, then commit or discard.
// ebbtide.checkpoint and the DCP plugin drive every save through it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "ebbtide/ckpt/writer.hpp"

namespace ebbtide::ckpt {

inline constexpr size_t kMaxStripeDirs = 255;  // a chunk's stripe number is 0..255, 0 the shard file
inline constexpr const char* kStripeOwnerName = "owner.json";

// 8 hex digits naming the absolute checkpoint path `path` in the names of its
// stripe directories, <dir>/<basename>.stripe-<tag>-<id> (a SHA-1 prefix).
std::string stripe_path_tag(const std::string& path);

// `dir` may hold stripe files of checkpoint `id`: an absolute, normalised
// path whose last component is a stripe directory name
// <name>.stripe-[<tag>-]<id>. Looks at the string only.
bool stripe_dir_matches(const std::string& dir, const std::string& id);

// Stripe directory `dir` provably belongs to checkpoint `path` (absolute,
// normalised) with id `id`: stripe_dir_matches, named for `path`, a real
// directory (not a symlink) whose owner file (a regular file) names `path`
// and `id`. Never throws.
bool owned_stripe_dir(const std::string& dir, const std::string& path, const std::string& id);

// One save of checkpoint directory `path`. Not thread-safe. Nothing happens
// on destruction: a reserved save must end in commit(), committed() or
// discard() (a save the writer committed must not be discarded).
class SaveTransaction {
 public:
  // Checks `stripe_dirs` (existing directories, none twice, none inside the
  // checkpoint, at most kMaxStripeDirs; InvalidArgument), creates the
  // checkpoint's parent directory, removes what killed saves of `path` left
  // (PATH.tmp-*, and stripe directories of `path` that no committed
  // checkpoint refers to), notes the stripe directories the committed
  // checkpoint's record names (`record`: a JSON file in `path` with "id" and
  // "stripes", or "" for none; only those proven ours by owned_stripe_dir), then makes
  // PATH.tmp-XXXXXX and one stripe directory with its owner file in each of
  // `stripe_dirs`, all for a new checkpoint id. IoError naming what it cannot
  // make; what it made is removed again.
  static SaveTransaction reserve(const std::string& path, const std::vector<std::string>& stripe_dirs,
                                 const std::string& record);

  const std::string& path() const { return path_; }        // absolute, normalised
  const std::string& id() const { return id_; }            // the new checkpoint's id (32 hex digits)
  const std::string& tmp_dir() const { return tmp_dir_; }  // committed to path() by rename
  const std::vector<std::string>& stripes() const { return stripes_; }  // one per stripe_dirs entry

  // tmp_dir() was committed (by the writer: SaveRequest::commit_path, or
  // CheckpointWriter::commit): removes the replaced checkpoint's stripe
  // directories. Never throws.
  void committed() noexcept;
  // The save failed before its commit: removes tmp_dir() and stripes().
  // Never throws.
  void discard() noexcept;

 private:
  std::string path_, id_, tmp_dir_;
  std::vector<std::string> stripes_;
  std::string replaced_id_;                    // the committed checkpoint's id at reserve()
  std::vector<std::string> replaced_stripes_;  // its stripe directories, proven ours
};

}  // namespace ebbtide::ckpt
