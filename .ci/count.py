"""Fails a CI environment whose test run counted fewer passed tests than its floor.

    python .ci/count.py REPORT.xml FLOOR NAME

REPORT.xml: pytest's JUnit report (PYTEST_ADDOPTS=--junitxml=...). The floor is what the
environment exists to run; a package that installs but does not work shows up as skips, and
skips do not count.
"""

import sys
import xml.etree.ElementTree as ET


def main() -> int:
    report, floor, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    print(f"CI {name}: {passed} passed, {total['skipped']} skipped, {total['failures'] + total['errors']} failed "
          f"(floor {floor} passed)")
    if passed < floor:
        print(f"CI {name}: only {passed} tests passed, fewer than the {floor} this environment exists to run "
              "(a package that did not import skips its tests)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
