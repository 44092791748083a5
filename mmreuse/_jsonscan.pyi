"""Types of the proxy's request-body scan (csrc/json_scan.cpp)."""

def scan(
    body: bytes | bytearray | memoryview, plain_min: int, /
) -> tuple[int, int, int, list[int]]: ...
