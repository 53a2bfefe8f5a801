// The CPU kernels as one extension (kernels/cpu_module.py says why): each kernel in a namespace of its
// own, in this order (`lin` calls `pn`, `qt` calls `lin`), the functions Python binds put at global scope, then the
// driver that calls them all. `cpu_module` splices the local includes into one text, which the
// build cache keys and compiles (kernels/build.py).
#include "panels.cpp"
#include "linear.cpp"
#include "quant.cpp"
#include "pointwise.cpp"
#include "lora.cpp"
#include "paged_attention.cpp"

using pn::panel_width;
using pn::rows;
using lin::linear;
using lin::max_rows;
using qt::quant_rows;
using qt::quant_max_rows;
using pw::rms_norm;
using pw::add_rms_norm;
using pw::rope_;
using pw::silu_mul;
using pw::greedy;
using pw::write_kv;
using lo::lora;
using att::paged_decode;

#include "decode_layers.cpp"
