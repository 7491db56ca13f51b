"""Counting what an HLO module reads: the parameters of its ENTRY computation."""


def hlo_parameter_count(hlo_text: str) -> int:
    """Parameters of the ENTRY computation of an HLO module's text: the data a
    computation reads from the device."""
    lines = iter(hlo_text.splitlines())
    for line in lines:
        if line.startswith("ENTRY "):
            break
    count = 0
    for line in lines:
        if line.startswith("}"):
            break
        count += " parameter(" in line
    return count
