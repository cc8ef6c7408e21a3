// ebbtide._core: the binding areas, util first (its exception types and
// translator, and build_info, which cache extends).
#include "bind.hpp"

NB_MODULE(_core, m) {
  using namespace ebbtide::py;
  bind_util(m);
  bind_mem(m);
  bind_io(m);
  bind_cache(m);
  bind_ckpt(m);
  bind_safetensors(m);
  bind_plan(m);
}
