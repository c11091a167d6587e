import pytest
from headroom.client.workloads import builtin_workloads, check_fits, scale_workload


def test_field_report_sizes():
    catalogue = builtin_workloads()
    hom = catalogue["hom_c8_2k_each"].requests
    assert len(hom) == 8 and {spec.prompt_tokens for spec in hom} == {2189}
    mix = catalogue["mix_short6_long2_c8"].requests
    assert sorted(spec.label for spec in mix) == ["long"] * 2 + ["short"] * 6
    assert {spec.prompt_tokens for spec in catalogue["prefill_heavy_c4_4k_each"].requests} == {4323}
    assert len(catalogue["long4_short_mid"].requests) == 5
    chains = catalogue["chains_k3_revisit"]
    assert len(chains.phases) == 9 and {spec.shared_prefix_tokens for spec in chains.requests} == {66000}
    assert len({spec.session for spec in catalogue["hom_c8_2k_each"].requests}) == 8


def test_scaling_keeps_floors_structure_and_the_shared_prefix():
    chains = scale_workload(builtin_workloads()["chains_k3_revisit"], 0.01)
    spec = chains.requests[0]
    assert (spec.prompt_tokens, spec.shared_prefix_tokens, spec.max_tokens) == (660, 656, 4)
    tiny = scale_workload(builtin_workloads()["hom_c8_2k_each"], 0.0001)
    assert {s.prompt_tokens for s in tiny.requests} == {8}


def test_max_prompt_tokens_caps_every_prompt():
    capped = scale_workload(builtin_workloads()["long4_short_mid"], 1.0, max_prompt_tokens=1000)
    assert max(spec.prompt_tokens for spec in capped.requests) == 1000
    chains = scale_workload(builtin_workloads()["chains_k3_revisit"], 1.0, max_prompt_tokens=500)
    assert {(s.prompt_tokens, s.shared_prefix_tokens) for s in chains.requests} == {(500, 468)}


def test_workload_that_cannot_fit_is_refused_with_numbers():
    with pytest.raises(ValueError, match="4323 prompt \\+ 128 output tokens exceeds context length 4096"):
        check_fits(builtin_workloads()["prefill_heavy_c4_4k_each"], 4096)
    with pytest.raises(ValueError, match="got 0"):
        scale_workload(builtin_workloads()["hom_c8_2k_each"], 0)


def test_any_number_of_chains_by_name():
    from headroom.client.workloads import find_workload

    two = find_workload("chains_k2_revisit")
    assert len(two.phases) == 6 and [s.label for s in two.requests][:3] == ["lap1", "lap1", "lap2"]
    assert find_workload("hom_c8_2k_each").name == "hom_c8_2k_each"
    with pytest.raises(ValueError, match="chains_k<K>_revisit"):
        find_workload("chains_kx_revisit")
    with pytest.raises(ValueError, match="K >= 1"):
        find_workload("chains_k0_revisit")
