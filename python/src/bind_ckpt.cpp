// Checkpoint writer/reader bindings: the Python glue (ebbtide/checkpoint/native_save.py)
// flattens state dicts into blobs (pointer, size) and JSON metadata.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "fork_safe.hpp"
#include "bind.hpp"
#include "ebbtide/ckpt/codec.hpp"
#include "ebbtide/ckpt/reader.hpp"
#include "ebbtide/ckpt/stripes.hpp"
#include "ebbtide/ckpt/transaction.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/io/faults.hpp"
#include "ebbtide/util/error.hpp"

namespace nb = nanobind;

// No file-scope using-directive (Note [Unity build] in CMakeLists.txt).
namespace ebbtide::ckpt {
namespace {

// (name, ptr, nbytes, device, stream, elem_bytes, codec)
using BlobTuple = std::tuple<std::string, uintptr_t, uint64_t, bool, uintptr_t, uint16_t, std::string>;

nb::dict result_dict(const SaveResult& r) {
  nb::dict d;
  d["file"] = r.file;
  d["raw_bytes"] = r.raw_bytes;
  d["stored_bytes"] = r.stored_bytes;
  d["file_bytes"] = r.file_bytes;
  d["snapshot_seconds"] = r.snapshot_seconds;
  d["total_seconds"] = r.total_seconds;
  d["backend"] = r.backend;
  return d;
}

// A vector as a 1-D torch tensor that owns it.
template <class T>
nb::object owned_tensor(std::vector<T>&& v) {
  auto [cap, keep] = ebbtide::py::owning_capsule(std::move(v));
  return ebbtide::py::tensor_1d(keep->data(), keep->size(), cap);
}

// Bytes [offset, offset + nbytes) of a staging buffer as a uint8 tensor that keeps the buffer alive.
nb::object staging_tensor(StagingBuffer&& buf, uint64_t offset, uint64_t nbytes) {
  auto [cap, keep] = ebbtide::py::owning_capsule(std::move(buf));
  return ebbtide::py::tensor_1d(static_cast<uint8_t*>((*keep)->data()) + offset, nbytes, cap);
}

nb::dict coded_dict(excp::Coded&& c) {
  nb::dict d;
  d["mask"] = owned_tensor(std::move(c.mask));
  d["codes"] = owned_tensor(std::move(c.codes));
  d["codebook"] = owned_tensor(std::move(c.codebook));
  d["count"] = c.count;
  d["kept"] = c.kept;
  d["max_abs"] = c.max_abs;
  d["sq_err"] = c.sq_err;
  d["sq_ref"] = c.sq_ref;
  return d;
}

}  // namespace
}  // namespace ebbtide::ckpt

void ebbtide::py::bind_ckpt(nb::module_& m) {
  using namespace ebbtide::ckpt;
  m.attr("CKPT_FORMAT_VERSION") = kFormatVersion;
  m.def("ckpt_have_zstd", &have_zstd);

  nb::class_<SaveHandle>(m, "CkptSaveHandle")
      .def("done", &SaveHandle::done)
      .def("wait_copied",
           [](const SaveHandle& h) {
             ebbtide::py::gil_release g;
             h.wait_copied();
           })
      .def("wait_written",
           [](const SaveHandle& h) {
             ebbtide::py::gil_release g;
             h.wait_written();
           },
           "Blocks until the save's sources are written and durable (or the save is done).")
      .def("approve", &SaveHandle::approve)
      .def("reject", &SaveHandle::reject, nb::arg("why"))
      .def("wait", [](const SaveHandle& h) {
        SaveResult r;
        {
          ebbtide::py::gil_release g;
          r = h.wait();
        }
        return result_dict(r);
      });

  nb::class_<CheckpointWriter>(m, "CkptWriter")
      .def("__init__",
           [](CheckpointWriter* self, std::optional<uint64_t> chunk_bytes, std::optional<unsigned> queue_depth,
              std::optional<unsigned> threads, std::optional<int> zstd_level, std::optional<bool> direct) {
             WriterOptions o = WriterOptions{}.with_env();
             if (chunk_bytes) o.chunk_bytes = *chunk_bytes;
             if (queue_depth) o.queue_depth = *queue_depth;
             if (threads) o.threads = *threads;
             if (zstd_level) o.zstd_level = *zstd_level;
             if (direct) o.direct = *direct;
             new (self) CheckpointWriter(o);
           },
           nb::arg("chunk_bytes") = nb::none(), nb::arg("queue_depth") = nb::none(), nb::arg("threads") = nb::none(),
           nb::arg("zstd_level") = nb::none(), nb::arg("direct") = nb::none())
      .def("save",
           [](CheckpointWriter& w, const std::string& file, const std::vector<BlobTuple>& blobs, const std::string& meta,
              const std::string& commit_dir, const std::string& commit_path,
              const std::vector<std::pair<std::string, std::string>>& extra_files, bool block,
              const std::vector<std::string>& stripe_files, bool pipelined, bool gated,
              const std::vector<std::pair<nb::bytes, nb::bytes>>& frames, uint64_t reserve_arena) {
             if (!frames.empty() && frames.size() != blobs.size())
               throw ebbtide::InvalidArgument(ebbtide::detail::concat("save: ", frames.size(), " frames for ",
                                                                      blobs.size(), " blobs"));
             SaveRequest req;
             req.stripe_files = stripe_files;
             req.pipelined = pipelined;
             req.gated = gated;
             req.reserve_arena = reserve_arena;
             req.file = file;
             req.meta = meta;
             req.commit_dir = commit_dir;
             req.commit_path = commit_path;
             req.extra_files = extra_files;
             for (const auto& [name, ptr, nbytes, device, stream, elem, codec] : blobs) {
               req.blobs.push_back({name, ebbtide::py::pointer_buffer(ptr, nbytes, device, stream), elem,
                                    parse_codec(codec)});
             }
             for (size_t i = 0; i < frames.size(); ++i) {  // Note [Framed blobs]
               req.blobs[i].head.assign(frames[i].first.c_str(), frames[i].first.size());
               req.blobs[i].tail.assign(frames[i].second.c_str(), frames[i].second.size());
             }
             ebbtide::py::gil_release g;
             return w.save(std::move(req), block);
           },
           nb::arg("file"), nb::arg("blobs"), nb::arg("meta"), nb::arg("commit_dir") = "", nb::arg("commit_path") = "",
           nb::arg("extra_files") = std::vector<std::pair<std::string, std::string>>{}, nb::arg("block") = false,
           nb::arg("stripe_files") = std::vector<std::string>{}, nb::arg("pipelined") = false,
           nb::arg("gated") = false, nb::arg("frames") = std::vector<std::pair<nb::bytes, nb::bytes>>{},
           nb::arg("reserve_arena") = 0)
      .def("claim", [](CheckpointWriter& w, const std::string& target, bool block) {
        ebbtide::py::gil_release g;
        w.claim(target, block);
      }, nb::arg("target"), nb::arg("block") = false)
      .def("release_claim", &CheckpointWriter::release_claim)
      .def_prop_ro("busy", &CheckpointWriter::busy)
      .def("join", [](CheckpointWriter& w) {
        ebbtide::py::gil_release g;
        w.join();
      })
      .def("stage",
           [](CheckpointWriter& w, const std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t, bool, uintptr_t>>& copies) {
             std::vector<StageCopy> c;
             c.reserve(copies.size());
             for (const auto& [dst, src, n, device, stream] : copies)
               c.push_back({reinterpret_cast<void*>(dst), ebbtide::py::pointer_buffer(src, n, device, stream)});
             ebbtide::py::gil_release g;
             w.stage(c);
           },
           nb::arg("copies"),
           "Copies (dst, src, nbytes, device, stream) ranges as a snapshot does: device sources on their stream "
           "into the staging buffer, host ones on the writer's threads (Note [Staging buffer]).")
      .def("reserve_staging",
           [](CheckpointWriter& w, uint64_t nbytes, int device) {
             ebbtide::py::gil_release g;
             (void)w.reserve_staging(nbytes, device);
           },
           nb::arg("nbytes"), nb::arg("device") = -1,
           "Maps and faults in a staging buffer of nbytes on this thread (page-locked in CUDA device `device`'s "
           "context when >= 0) and makes it the writer's (Note [Staging buffer]).")
      .def_prop_ro("staging_buffer",
                   [](const CheckpointWriter& w) -> nb::object {
                     StagingBuffer buf = w.staging_buffer();
                     if (!buf) return nb::none();
                     const size_t size = buf->size();
                     return staging_tensor(std::move(buf), 0, size);
                   },
                   "The writer's staging buffer as a uint8 tensor that keeps it alive, or None.")
      .def("staging_view",
           [](const CheckpointWriter& w, uint64_t offset, uint64_t nbytes) {
             StagingBuffer buf = w.staging_buffer();
             if (!buf || offset > buf->size() || nbytes > buf->size() - offset)
               throw ebbtide::InvalidArgument(ebbtide::detail::concat(
                   "staging_view: bytes [", offset, ", ", offset + nbytes, ") lie outside the staging buffer of ",
                   buf ? buf->size() : 0, " bytes"));
             return staging_tensor(std::move(buf), offset, nbytes);
           },
           nb::arg("offset"), nb::arg("nbytes"),
           "Bytes [offset, offset + nbytes) of the staging buffer as a uint8 tensor with a storage of its own "
           "that keeps the buffer alive (a staged tensor's storage, Note [Staging buffer]).")
      .def("commit",
           [](CheckpointWriter& w, SaveTransaction& t, const std::vector<std::pair<std::string, nb::bytes>>& files) {
             std::vector<NamedContent> f;
             for (const auto& [name, content] : files) f.emplace_back(name, std::string(content.c_str(), content.size()));
             ebbtide::py::gil_release g;
             w.commit(t, f);
           },
           nb::arg("transaction"), nb::arg("files") = std::vector<std::pair<std::string, nb::bytes>>{},
           "Commits a save that `transaction` reserved (Note [Deferred removal]).")
      .def("excp_encode_many",
           [](CheckpointWriter& w,
              const std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t, uintptr_t, uintptr_t, uintptr_t, bool>>& weights,
              double density, double tolerance, double alpha, double beta, int bits, int bits_moments,
              int kmeans_iters) {
             std::vector<excp::Job> jobs;
             jobs.reserve(weights.size());
             for (const auto& [weight, base, n, m, v, base_v, carry_v] : weights) {
               excp::Job j;
               j.in.w = reinterpret_cast<const float*>(weight);
               j.in.base = reinterpret_cast<const float*>(base);
               j.in.n = n;
               j.in.m = reinterpret_cast<const float*>(m);
               j.in.v = reinterpret_cast<const float*>(v);
               j.in.base_v = reinterpret_cast<const float*>(base_v);
               j.o.density = density;
               j.o.tolerance = tolerance;
               j.o.alpha = alpha;
               j.o.beta = beta;
               j.o.bits = bits;
               j.o.bits_moments = bits_moments;
               j.o.carry_v = carry_v;
               j.o.kmeans_iters = kmeans_iters;
               jobs.push_back(j);
             }
             std::vector<excp::Encoded> out;
             {
               ebbtide::py::gil_release g;
               out = w.encode_deltas(jobs);
             }
             nb::list result;
             for (size_t i = 0; i < out.size(); ++i) {
               nb::dict d;
               d["w"] = coded_dict(std::move(out[i].w));
               if (jobs[i].in.m != nullptr) {
                 d["m"] = coded_dict(std::move(out[i].m));
                 d["v"] = coded_dict(std::move(out[i].v));
               }
               d["carried"] = out[i].carried;
               result.append(d);
             }
             return result;
           },
           nb::arg("weights"), nb::arg("density") = 0.1, nb::arg("tolerance") = 0.0, nb::arg("alpha") = -1.0,
           nb::arg("beta") = 0.0, nb::arg("bits") = 4, nb::arg("bits_moments") = 4, nb::arg("kmeans_iters") = 8,
           "ExCP-encodes fp32 weights, [(weight, base, n, m, v, base_v, carry_v)]: pointers to n floats (m, v, "
           "base_v 0 when absent), whole weights side by side on the writer's threads (Note [ExCP encoding], Note "
           "[ExCP batches]). One result per weight: {'w', 'm', 'v': {mask, codes, codebook, count, kept, "
           "max_abs, sq_err, sq_ref}, 'carried'}.")
      .def_prop_ro("snapshot_capacity", &CheckpointWriter::snapshot_capacity)
      .def_prop_ro("chunk_bytes", [](const CheckpointWriter& w) { return w.options().chunk_bytes; });

  nb::class_<ShardReader>(m, "CkptReader")
      .def(nb::init<const std::string&, bool, std::vector<std::string>>(), nb::arg("path"), nb::arg("direct") = true,
           nb::arg("stripes") = std::vector<std::string>{})
      .def_prop_ro("stripe_count", &ShardReader::stripe_count)
      .def_prop_ro("meta", [](const ShardReader& r) { return nb::bytes(r.header().meta.data(), r.header().meta.size()); })
      .def_prop_ro("format_version", [](const ShardReader& r) { return r.superblock().format_version; })
      .def_prop_ro("file_bytes", &ShardReader::file_bytes)
      .def_prop_ro("path", &ShardReader::path)
      .def_prop_ro("blobs", [](const ShardReader& r) {
        nb::list out;
        const auto& h = r.header();
        for (const auto& b : h.blobs) {
          const BlobExtent e = blob_extent(h, b);
          nb::dict d;
          d["name"] = b.name;
          d["nbytes"] = b.nbytes;
          d["stored_bytes"] = e.stored_bytes;
          d["codec"] = std::string(to_string(b.codec));
          d["elem_bytes"] = b.elem_bytes;
          d["chunks"] = b.chunk_count;
          d["offset"] = e.first_offset;
          d["stripe"] = e.first_stripe;
          d["stripes"] = e.stripes;
          out.append(d);
        }
        return out;
      })
      .def("read",
           [](ShardReader& r, const std::vector<std::tuple<uint32_t, uintptr_t, uint64_t, bool, uintptr_t>>& targets,
              unsigned threads) {
             std::vector<BlobTarget> t;
             for (const auto& [blob, ptr, nbytes, device, stream] : targets)
               t.push_back({blob, ebbtide::py::pointer_buffer(ptr, nbytes, device, stream)});
             ebbtide::py::gil_release g;
             r.read(t, threads);
           },
           nb::arg("targets"), nb::arg("threads") = 0)
      .def("read_parts",
           [](ShardReader& r,
              const std::vector<std::tuple<uint32_t, uint64_t, uintptr_t, uint64_t, bool, uintptr_t>>& targets,
              unsigned threads) {
             std::vector<BlobTarget> t;
             for (const auto& [blob, offset, ptr, nbytes, device, stream] : targets)
               t.push_back({blob, ebbtide::py::pointer_buffer(ptr, nbytes, device, stream), offset, true});
             ebbtide::py::gil_release g;
             r.read(t, threads);
           },
           nb::arg("targets"), nb::arg("threads") = 0,
           "Reads (blob, byte offset, pointer, nbytes, device, stream): part of each blob, bounds-checked against "
           "it, into host memory or (device) CUDA memory on that stream.")
      .def("check_extents", &ShardReader::check_extents,
           "Raises what read() would for the first chunk it cannot read (a stripe file missing or bad, a chunk "
           "past the end of its file), without reading data.")
      .def("verify", [](ShardReader& r) {
        std::vector<VerifyProblem> p;
        {
          ebbtide::py::gil_release g;
          p = r.verify();
        }
        nb::list out;
        for (const auto& x : p) out.append(nb::make_tuple(x.blob, x.file_offset, x.message));
        return out;
      });

  nb::class_<SaveTransaction>(m, "CkptSaveTransaction")
      .def_static("reserve",
                  [](const std::string& path, const std::vector<std::string>& stripe_dirs, const std::string& record) {
                    ebbtide::py::gil_release g;
                    return SaveTransaction::reserve(path, stripe_dirs, record);
                  },
                  nb::arg("path"), nb::arg("stripe_dirs"), nb::arg("record"))
      .def_prop_ro("path", &SaveTransaction::path)
      .def_prop_ro("id", &SaveTransaction::id)
      .def_prop_ro("tmp_dir", &SaveTransaction::tmp_dir)
      .def_prop_ro("stripes", &SaveTransaction::stripes)
      .def("committed", [](SaveTransaction& t) {
        ebbtide::py::gil_release g;
        t.committed();
      })
      .def("discard", [](SaveTransaction& t) {
        ebbtide::py::gil_release g;
        t.discard();
      });
  m.def("ckpt_stripe_path_tag", &stripe_path_tag, nb::arg("path"));
  m.def("ckpt_stripe_dir_matches", &stripe_dir_matches, nb::arg("dir"), nb::arg("id"));
  m.def("ckpt_owned_stripe_dir", &owned_stripe_dir, nb::arg("dir"), nb::arg("path"), nb::arg("id"));
  m.def("ckpt_probe_file", [](const std::string& path) {
    FileProbe p = probe_file(path);
    return nb::make_tuple(p.size, p.shard);
  }, nb::arg("path"));
  m.def("ckpt_read_file_ranges",
        [](const std::string& path, const std::vector<std::tuple<uint64_t, uint64_t, uintptr_t>>& ranges) {
          std::vector<FileRange> r;
          for (const auto& [off, len, ptr] : ranges) r.push_back({off, len, reinterpret_cast<void*>(ptr)});
          ebbtide::py::gil_release g;
          read_file_ranges(path, r);
        },
        nb::arg("path"), nb::arg("ranges"));
  m.def("ckpt_inject_write_fault", &inject_write_fault, nb::arg("after_bytes"), nb::arg("err"));
  m.def("ckpt_hold_writes", &ebbtide::io::hold_file_writes, nb::arg("hold"));
  leak_in_forked_children<CheckpointWriter>(m.attr("CkptWriter"));  // Note [Objects across fork]
  leak_in_forked_children<ShardReader>(m.attr("CkptReader"));
}
