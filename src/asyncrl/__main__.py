import sys

from asyncrl.cli import main

# guarded: multiprocessing's spawn start method (the sidecar's engine process) imports this module again
if __name__ == "__main__":
    sys.exit(main())
