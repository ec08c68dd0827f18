from rlhf_sg.cli import main

main()
