from flash_msa.cli import main


def test_demo_runs_and_checks(capsys):
    assert main(["demo", "--cpu", "--seq-len", "512", "--block-size", "64"]) == 0
    printed = capsys.readouterr().out
    assert "density" in printed and "passed" in printed and "[X]" in printed


def test_show_ascii_and_png(tmp_path, capsys):
    assert main(["show", "sliding_window", "--seq-len", "1024", "--window", "256"]) == 0
    assert "[X][X][X][ ]" in capsys.readouterr().out
    path = tmp_path / "bigbird.png"
    arguments = ["show", "bigbird", "--window", "256", "--num-global", "128", "--num-random", "2"]
    assert main([*arguments, "--no-causal", "--out", str(path)]) == 0
    assert path.stat().st_size > 0
