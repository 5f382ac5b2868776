from pcc_plugin.cli import main

main()
