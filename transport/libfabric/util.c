/* util.c: a uint64 -> uint64 hash map (linear probing, backward-shift
 * deletion) and a byte hash, used by the AV and the endpoints' peer maps. */
#include <stdlib.h>

#include "mrfi.h"

uint64_t mrfi_hash_bytes(const void *p, size_t n)
{
	const uint8_t *b = p;
	uint64_t h = 1469598103934665603ULL; /* FNV-1a */
	for (size_t i = 0; i < n; i++) {
		h ^= b[i];
		h *= 1099511628211ULL;
	}
	return h;
}

static size_t slot_of(uint64_t key, size_t cap)
{
	key ^= key >> 33;
	key *= 0xff51afd7ed558ccdULL;
	key ^= key >> 33;
	return (size_t)key & (cap - 1);
}

void mrfi_map_free(struct mrfi_map *m)
{
	free(m->keys);
	free(m->vals);
	free(m->used);
	memset(m, 0, sizeof(*m));
}

static int map_grow(struct mrfi_map *m)
{
	size_t cap = m->cap ? m->cap * 2 : 16;
	struct mrfi_map n = {
		.keys = calloc(cap, sizeof(uint64_t)),
		.vals = calloc(cap, sizeof(uint64_t)),
		.used = calloc(cap, 1),
		.cap = cap,
	};
	if (!n.keys || !n.vals || !n.used) {
		mrfi_map_free(&n);
		return -FI_ENOMEM;
	}
	for (size_t i = 0; i < m->cap; i++)
		if (m->used[i])
			mrfi_map_put(&n, m->keys[i], m->vals[i]);
	mrfi_map_free(m);
	*m = n;
	return 0;
}

int mrfi_map_put(struct mrfi_map *m, uint64_t key, uint64_t val)
{
	if ((m->len + 1) * 4 > m->cap * 3) {
		int rc = map_grow(m);
		if (rc)
			return rc;
	}
	size_t i = slot_of(key, m->cap);
	while (m->used[i]) {
		if (m->keys[i] == key) {
			m->vals[i] = val;
			return 0;
		}
		i = (i + 1) & (m->cap - 1);
	}
	m->used[i] = 1;
	m->keys[i] = key;
	m->vals[i] = val;
	m->len++;
	return 0;
}

bool mrfi_map_get(const struct mrfi_map *m, uint64_t key, uint64_t *val)
{
	if (!m->cap)
		return false;
	size_t i = slot_of(key, m->cap);
	while (m->used[i]) {
		if (m->keys[i] == key) {
			*val = m->vals[i];
			return true;
		}
		i = (i + 1) & (m->cap - 1);
	}
	return false;
}

void mrfi_map_del(struct mrfi_map *m, uint64_t key)
{
	if (!m->cap)
		return;
	size_t mask = m->cap - 1, i = slot_of(key, m->cap);
	while (m->used[i] && m->keys[i] != key)
		i = (i + 1) & mask;
	if (!m->used[i])
		return;
	/* Backward-shift the run after i so lookups never stop early. */
	size_t j = i;
	for (;;) {
		j = (j + 1) & mask;
		if (!m->used[j])
			break;
		size_t home = slot_of(m->keys[j], m->cap);
		/* Move j into the hole at i unless its home lies in (i, j]. */
		bool between = (i <= j) ? (home > i && home <= j)
					: (home > i || home <= j);
		if (between)
			continue;
		m->keys[i] = m->keys[j];
		m->vals[i] = m->vals[j];
		i = j;
	}
	m->used[i] = 0;
	m->len--;
}
