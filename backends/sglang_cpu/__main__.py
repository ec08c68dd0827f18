from backends.sglang_cpu import main

main()
