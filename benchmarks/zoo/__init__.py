"""The zoo: honest trainers generated from independent choices (model, loss, data helper, optimizer, clipping,
schedule, precision, layout), each with exactly the declarations it needs, run through the plugin as a
benchmark of false alarms, and with one self-test operator planted in each as a benchmark of kills.

    python -m benchmarks.zoo --seed S                        # one trainer's choices and how to run it
    python -m benchmarks.zoo run --count 200 --profile ci --jobs J     # reports/zoo/zoo.{json,md}

Design: docs/design/zoo.md.
"""
