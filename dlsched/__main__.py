"""``python -m dlsched`` runs the ``dlsched`` CLI."""

from dlsched.cli import main

if __name__ == "__main__":
    main()
