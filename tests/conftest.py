import os
import sys

# Spawned ranks import test helpers by module name; make tests/ importable for them too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
