"""The torchao release the float8 references are written against (scripts/versions.env pins
it), and the one way they refuse to run without it: print why and exit 3, which the C++
tests report as skipped."""
import sys

WANT = "0.18"


def require_torchao():
    """Imports torchao and checks its version; exits 3 (with the reason) otherwise."""
    try:
        import torchao
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
        print(f"no torchao: {type(e).__name__}: {e}")
        sys.exit(3)
    if not torchao.__version__.startswith(WANT):
        print(f"no torchao: found {torchao.__version__}, the reference is {WANT}.x")
        sys.exit(3)
    return torchao
