"""The thresholds table: every fitted number says what it decides and points at results that
exist in the repository; archs without measurements get sm_90's values, marked as such."""

import pathlib

from tileq.dispatch import thresholds

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_threshold_is_documented_and_backed():
    table = thresholds.for_arch("sm_90")
    assert len(table.entries) >= 50
    for name, t in table.entries.items():
        assert name.isupper() and t.decides.strip(), name
        assert (ROOT / t.evidence).exists(), f"{name}: {t.evidence} is not in the repository"
        assert getattr(table, name) == t.value


def test_other_archs_say_they_were_not_measured():
    assert "not measured on sm_89" in thresholds.for_arch("sm_89").measured_on
    assert thresholds.for_arch("sm_89").DECODE_MAX_M == thresholds.for_arch("sm_90").DECODE_MAX_M
    assert "not measured" not in thresholds.for_arch("sm_90").measured_on
