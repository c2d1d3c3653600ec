/*
 * libqpt: the shared library of qprobe's user-space probe tests.  uprog
 * calls qpt_lib_add through the PLT; tests probe it in the library, which
 * the guest has at /usr/lib/libqpt.so.  uprog-static links this file into
 * the program itself, so the same modes run in both builds.
 *
 * Built on the host with:
 *     gcc -shared -fPIC -O2 -g -Wall -Wl,-soname,libqpt.so -o libqpt.so libqpt.c
 */

/*
 * noipa: never inlined, cloned or specialised, so every call is a real call
 * of this symbol with its arguments in %rdi and %rsi and the result in %rax.
 */
__attribute__((noipa, used, visibility("default"))) long qpt_lib_add(long a, long b)
{
	return a + b;
}
