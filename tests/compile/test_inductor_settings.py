"""KEY=VALUE Inductor options (compile_passes/inductor_settings.py): values read as JSON of the
option's type, and one error naming the field, the text and what is allowed otherwise."""

import pytest

from compile_passes.inductor_settings import inductor_settings


def test_values_parse_as_json_of_the_options_type():
    assert inductor_settings(["combo_kernels=true", "combo_kernel_max_num_nodes=4",
                              "combo_kernel_peak_memory_pct_threshold=1",
                              "max_autotune_gemm_backends=ATEN"], "f") == {
        "combo_kernels": True, "combo_kernel_max_num_nodes": 4,
        "combo_kernel_peak_memory_pct_threshold": 1.0, "max_autotune_gemm_backends": "ATEN"}
    assert inductor_settings([], "f") == {}


@pytest.mark.parametrize(("texts", "message"), [
    (["combo_kernels"],
     "f: 'combo_kernels': give KEY=VALUE with KEY an option of torch._inductor.config"),
    (["combo_kernel=true"],
     "f: 'combo_kernel=true': give KEY=VALUE with KEY an option of torch._inductor.config"),
    (["combo_kernels=1"], "f: 'combo_kernels=1': combo_kernels takes a bool (default False)"),
    (["combo_kernel_max_num_nodes=true"],
     "f: 'combo_kernel_max_num_nodes=true': combo_kernel_max_num_nodes takes an int (default 8)"),
    (["combo_kernels=true", "combo_kernels=false"], "f: combo_kernels is given twice"),
])
def test_bad_settings_name_the_field_and_what_is_allowed(texts, message):
    with pytest.raises(ValueError) as info:
        inductor_settings(texts, "f")
    assert str(info.value) == message
