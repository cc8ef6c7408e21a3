// SaveTransaction: reserve / commit / discard of a checkpoint save's
// directories, stale-directory removal and the stripe ownership proofs (Note
// [Stripe ownership] in transaction.cpp); CheckpointWriter::claim.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::ckpt {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

constexpr const char* kRecord = "index.json";

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A record naming `stripes` for checkpoint `id`, as index.json does.
std::string record(const std::string& id, const std::vector<std::string>& stripes) {
  std::string s = "{\"format\": \"ebbtide-checkpoint\", \"id\": \"" + id + "\", \"stripes\": [";
  for (size_t i = 0; i < stripes.size(); ++i) s += (i ? ", \"" : "\"") + stripes[i] + "\"";
  return s + "]}";
}

// A directory holding a file, to see whether something removed it.
std::string planted(const std::string& dir) {
  fs::create_directories(dir);
  write(dir + "/keep.txt", "mine");
  return dir;
}

bool intact(const std::string& dir) { return read(dir + "/keep.txt") == "mine"; }

// Saves generation `gen` of `path` striped over `dirs`; returns its transaction.
SaveTransaction save(const std::string& path, const std::vector<std::string>& dirs, int gen) {
  SaveTransaction t = SaveTransaction::reserve(path, dirs, kRecord);
  for (const auto& sd : t.stripes()) write(sd + "/rank0.ebt", std::to_string(gen));
  CheckpointWriter w;
  w.commit(t, {{kRecord, record(t.id(), t.stripes())}, {"gen", std::to_string(gen)}});
  w.join();  // the replaced checkpoint goes on the writer's thread (Note [Deferred removal])
  return t;
}

TEST(StripeNames, PathTagIsTheSha1Prefix) {
  EXPECT_EQ(stripe_path_tag(""), "da39a3ee");
  EXPECT_EQ(stripe_path_tag("/data/ckpt/step100"), "5dc7d226");
  EXPECT_EQ(stripe_path_tag(std::string(200, 'a')), "e61cfffe");  // several SHA-1 blocks
}

TEST(StripeNames, MatchesOnlyNormalisedAbsoluteStripeDirectoriesOfTheId) {
  EXPECT_TRUE(stripe_dir_matches("/ssd/c.stripe-0123abcd-ff00", "ff00"));
  EXPECT_TRUE(stripe_dir_matches("/ssd/c.stripe-ff00", "ff00"));  // untagged (older saves)
  EXPECT_FALSE(stripe_dir_matches("/ssd/c.stripe-0123abcd-ff00", "ff01"));
  EXPECT_FALSE(stripe_dir_matches("ssd/c.stripe-ff00", "ff00"));          // relative
  EXPECT_FALSE(stripe_dir_matches("/ssd/../c.stripe-ff00", "ff00"));      // not normalised
  EXPECT_FALSE(stripe_dir_matches("/ssd//c.stripe-ff00", "ff00"));
  EXPECT_FALSE(stripe_dir_matches("/ssd/./c.stripe-ff00", "ff00"));
  EXPECT_FALSE(stripe_dir_matches("/ssd/c.stripe-ff00/", "ff00"));
  EXPECT_FALSE(stripe_dir_matches("/ssd/.stripe-ff00", "ff00"));          // no checkpoint name
  EXPECT_FALSE(stripe_dir_matches("/ssd/c.stripe-0123abcg-ff00", "ff00"));  // tag not hex
  EXPECT_FALSE(stripe_dir_matches("/ssd/precious", "ff00"));
  EXPECT_FALSE(stripe_dir_matches(std::string("/ssd/c.stripe-ff00\0x", 19), "ff00"));
}

TEST(SaveTransaction, CommitReplacesTheCheckpointAndItsStripes) {
  TempDir d;
  std::string path = d.path() + "/c", ssd = d.sub("ssd");
  SaveTransaction a = save(path, {ssd}, 0);
  ASSERT_EQ(a.stripes().size(), 1u);
  EXPECT_EQ(a.stripes()[0], ssd + "/c.stripe-" + stripe_path_tag(path) + "-" + a.id());
  EXPECT_TRUE(owned_stripe_dir(a.stripes()[0], path, a.id()));
  EXPECT_EQ(read(path + "/gen"), "0");
  SaveTransaction b = save(path, {ssd}, 1);
  EXPECT_EQ(read(path + "/gen"), "1");
  EXPECT_FALSE(fs::exists(a.stripes()[0])) << "the replaced checkpoint's stripes go after the commit";
  EXPECT_EQ(read(b.stripes()[0] + "/rank0.ebt"), "1");
  save(path, {}, 2);  // unstriped: the previous stripes go as well
  EXPECT_TRUE(fs::is_empty(ssd));
  EXPECT_EQ(d.entries(), 2u);  // c and ssd: no temporary directory left
}

TEST(SaveTransaction, ReserveRemovesStaleTemporaryDirectoriesOnly) {
  TempDir d;
  std::string path = d.path() + "/c";
  save(path, {}, 0);
  fs::create_directory(path + ".tmp-abcdef");  // a killed save's
  std::string other = planted(d.path() + "/cc.tmp-abcdef");      // another checkpoint's
  std::string longer = planted(path + ".tmp-abcdefg");            // not a mkdtemp name
  SaveTransaction t = SaveTransaction::reserve(path, {}, kRecord);
  EXPECT_FALSE(fs::exists(path + ".tmp-abcdef"));
  EXPECT_TRUE(intact(other) && intact(longer));
  EXPECT_TRUE(fs::is_directory(t.tmp_dir()));
  EXPECT_EQ(t.tmp_dir().rfind(path + ".tmp-", 0), 0u);
  t.discard();
}

TEST(SaveTransaction, DiscardRemovesOnlyWhatTheSaveMade) {
  TempDir d;
  std::string path = d.path() + "/c", ssd0 = d.sub("ssd0"), ssd1 = d.sub("ssd1");
  SaveTransaction a = save(path, {ssd0, ssd1}, 0);
  std::string foreign = planted(ssd0 + "/unrelated");
  SaveTransaction b = SaveTransaction::reserve(path, {ssd0, ssd1}, kRecord);
  ASSERT_EQ(b.stripes().size(), 2u);
  EXPECT_EQ(read(b.stripes()[1] + "/owner.json"),
            "{\"checkpoint\": \"" + path + "\", \"id\": \"" + b.id() + "\"}");
  b.discard();
  EXPECT_FALSE(fs::exists(b.tmp_dir()));
  EXPECT_FALSE(fs::exists(b.stripes()[0]) || fs::exists(b.stripes()[1]));
  EXPECT_EQ(read(path + "/gen"), "0");
  EXPECT_EQ(read(a.stripes()[0] + "/rank0.ebt"), "0") << "the committed checkpoint's stripes stay";
  EXPECT_TRUE(intact(foreign));
}

// Note [Stripe ownership]: directories the committed record lists are removed
// only when proven to be this checkpoint's.
TEST(SaveTransaction, RecordedStripesMustProveOwnership) {
  TempDir d;
  std::string path = d.path() + "/c", ssd = d.sub("ssd");
  SaveTransaction a = save(path, {ssd}, 0);
  const std::string name = "c.stripe-" + stripe_path_tag(path) + "-" + a.id();
  std::string outside = planted(d.path() + "/precious");
  std::string no_owner = planted(d.path() + "/elsewhere/" + name);
  std::string other_owner = planted(d.path() + "/other/" + name);
  write(other_owner + "/owner.json", "{\"checkpoint\": \"" + d.path() + "/x/c\", \"id\": \"" + a.id() + "\"}");
  std::string wrong_id = planted(d.path() + "/wrongid/" + name);
  write(wrong_id + "/owner.json", "{\"checkpoint\": \"" + path + "\", \"id\": \"0\"}");
  // A symlink with the right name to a directory with a valid owner file.
  std::string target = planted(d.path() + "/target");
  write(target + "/owner.json", "{\"checkpoint\": \"" + path + "\", \"id\": \"" + a.id() + "\"}");
  fs::create_directories(d.path() + "/links");
  std::string link = d.path() + "/links/" + name;
  fs::create_directory_symlink(target, link);
  std::string dotted = d.path() + "/links/../other/" + name;  // not normalised
  for (const auto& sd : {outside, no_owner, other_owner, wrong_id, link, dotted})
    EXPECT_FALSE(owned_stripe_dir(sd, path, a.id())) << sd;
  EXPECT_TRUE(owned_stripe_dir(a.stripes()[0], path, a.id()));

  write(path + "/" + kRecord, record(a.id(), {outside, no_owner, other_owner, wrong_id, link, dotted}));
  save(path, {}, 1);
  for (const auto& dir : {outside, no_owner, other_owner, wrong_id, target}) EXPECT_TRUE(intact(dir)) << dir;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::exists(a.stripes()[0])) << "no longer listed: not known to be replaced";
}

TEST(SaveTransaction, StaleStripesAreRemovedByNameOrOwner) {
  TempDir d;
  std::string path = d.path() + "/c", ssd = d.sub("ssd");
  save(path, {ssd}, 0);
  const std::string tag = stripe_path_tag(path);
  std::string orphan = planted(ssd + "/c.stripe-" + tag + "-dead");  // killed before owner.json
  std::string half = planted(ssd + "/c.stripe-" + tag + "-feed");
  write(half + "/owner.json", "{\"checkpoint\": ");
  std::string untagged = planted(ssd + "/c.stripe-0ld");  // an older save's name, owner names us
  write(untagged + "/owner.json", "{\"checkpoint\": \"" + path + "\", \"id\": \"0ld\"}");
  std::string foreign = planted(ssd + "/c.stripe-0123abcd-cafe");  // another path's tag
  std::string collision = planted(ssd + "/c.stripe-" + tag + "-0ther");
  write(collision + "/owner.json", "{\"checkpoint\": \"" + d.path() + "/elsewhere/c\", \"id\": \"0ther\"}");
  std::string file = ssd + "/c.stripe-" + tag + "-f11e";
  write(file, "not a directory");
  std::string target = planted(d.path() + "/target");
  fs::create_directory_symlink(target, ssd + "/c.stripe-" + tag + "-11nk");
  SaveTransaction t = save(path, {ssd}, 1);
  EXPECT_FALSE(fs::exists(orphan) || fs::exists(half) || fs::exists(untagged));
  EXPECT_TRUE(intact(foreign) && intact(collision) && intact(target));
  EXPECT_EQ(read(file), "not a directory");
  EXPECT_TRUE(fs::is_symlink(ssd + "/c.stripe-" + tag + "-11nk"));
  EXPECT_TRUE(fs::exists(t.stripes()[0]));
}

TEST(SaveTransaction, BadStripeDirectoriesThrowBeforeAnythingIsMade) {
  TempDir d;
  std::string path = d.path() + "/sub/c", ssd = d.sub("ssd");
  EXPECT_THROW(SaveTransaction::reserve(path, {d.path() + "/nope"}, kRecord), InvalidArgument);
  EXPECT_THROW(SaveTransaction::reserve(path, {ssd, ssd + "/"}, kRecord), InvalidArgument);  // twice
  fs::create_directories(path + "/inner");
  EXPECT_THROW(SaveTransaction::reserve(path, {path + "/inner"}, kRecord), InvalidArgument);
  fs::remove_all(d.path() + "/sub");
  std::vector<std::string> many;
  for (size_t i = 0; i <= kMaxStripeDirs; ++i) many.push_back(d.sub("s" + std::to_string(i)));
  EXPECT_THROW(SaveTransaction::reserve(path, many, kRecord), InvalidArgument);
  EXPECT_FALSE(fs::exists(d.path() + "/sub"));
}

TEST(CheckpointWriterClaim, ClaimedWriterRefusesASecondSave) {
  TempDir d;
  CheckpointWriter w;
  w.claim(d.path() + "/a");
  EXPECT_TRUE(w.busy());
  EXPECT_THROW(w.claim(d.path() + "/b"), StateError);
  w.release_claim();
  EXPECT_FALSE(w.busy());
  w.claim(d.path() + "/a");
  SaveRequest r;
  r.file = d.path() + "/a.ebt";
  w.save(r).wait();  // the claimed save takes the claim
  EXPECT_FALSE(w.busy());
  w.claim(d.path() + "/b");
  w.release_claim();
}

}  // namespace
}  // namespace ebbtide::ckpt
