// The engine's CPU kernels, one extension (platform/native.py builds it on first use):
// decode attention through the paged cache, packed attention without a cache (embedding
// models), the sampling step, RMSNorm and rotary.
#include <torch/extension.h>

#include "decode_attention.h"
#include "elementwise.h"
#include "packed_attention.h"
#include "sample_rows.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention through a paged cache (float32, CPU)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("table"), py::arg("lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::arg("tiles") = true);
  m.def("packed_attention", &packed_attention,
        "attention of packed inputs over their own tokens (float32, CPU)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("starts"), py::arg("lengths"), py::arg("scale"),
        py::arg("causal"));
  m.def("packed_attention_dims", &packed_attention_dims,
        "packed_attention takes head dims that are multiples of this");
  m.def("sample_rows", &sample_rows, "one sampling step, every row (float32, CPU)",
        py::arg("logits"), py::arg("offset"), py::arg("counts"), py::arg("inv_t"),
        py::arg("greedy"), py::arg("top_p"), py::arg("presence"), py::arg("frequency"),
        py::arg("ring"), py::arg("cursor"), py::arg("allow"), py::arg("k_top"));
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm in one pass (float32, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rotary_embed", &rotary_embed, "apply_rotary_pos_emb in one pass (float32, CPU)",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"));
}
