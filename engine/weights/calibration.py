"""Calibration text for GPTQ: a small, fixed mix of styles, each entry one sequence.

Public-domain passages (Austen, Melville, Carroll, Lincoln, the US Declaration of Independence)
plus short expository prose, code, a recipe-style list and a dialogue written for this file.
GPTQ only needs inputs that exercise each layer the way ordinary text does; a mix of registers
keeps any one style from dominating the second moments. Nothing here comes from the texts the
tests measure perplexity on.
"""

from __future__ import annotations

CALIBRATION_TEXTS: tuple[str, ...] = (
    # Jane Austen, "Pride and Prejudice" (1813), chapter 1.
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such a "
    "man may be on his first entering a neighbourhood, this truth is so well fixed in the minds "
    "of the surrounding families, that he is considered the rightful property of some one or "
    'other of their daughters. "My dear Mr. Bennet," said his lady to him one day, "have you '
    'heard that Netherfield Park is let at last?" Mr. Bennet replied that he had not. "But it '
    'is," returned she; "for Mrs. Long has just been here, and she told me all about it." Mr. '
    'Bennet made no answer. "Do you not want to know who has taken it?" cried his wife '
    'impatiently. "You want to tell me, and I have no objection to hearing it." This was '
    "invitation enough.",
    # Herman Melville, "Moby-Dick" (1851), chapter 1.
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money "
    "in my purse, and nothing particular to interest me on shore, I thought I would sail about "
    "a little and see the watery part of the world. It is a way I have of driving off the "
    "spleen and regulating the circulation. Whenever I find myself growing grim about the "
    "mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself "
    "involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral "
    "I meet; then, I account it high time to get to sea as soon as I can.",
    # Written for this file: expository prose with figures.
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light; "
    "the energy splits water molecules, releasing oxygen, and drives the reactions that fix "
    "carbon dioxide into sugars. A mature tree can absorb roughly 20 to 25 kilograms of CO2 a "
    "year. The overall reaction is often summarised as 6 CO2 + 6 H2O -> C6H12O6 + 6 O2, though "
    "the real pathway, the Calvin cycle, involves more than a dozen intermediate steps. Rates "
    "depend on light intensity, temperature and the concentration of carbon dioxide.",
    # Written for this file: code.
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list in O(len(a) + len(b))."""\n'
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            out.append(b[j])\n"
    "            j += 1\n"
    "    return out + a[i:] + b[j:]\n\n\n"
    'if __name__ == "__main__":\n'
    "    print(merge_sorted([1, 4, 9], [2, 3, 10, 11]))  # [1, 2, 3, 4, 9, 10, 11]\n",
    # Lewis Carroll, "Alice's Adventures in Wonderland" (1865), chapter 1.
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
    'had no pictures or conversations in it, "and what is the use of a book," thought Alice '
    '"without pictures or conversations?" So she was considering in her own mind (as well as '
    "she could, for the hot day made her feel very sleepy and stupid), whether the pleasure of "
    "making a daisy-chain would be worth the trouble of getting up and picking the daisies, "
    "when suddenly a White Rabbit with pink eyes ran close by her.",
    # Written for this file: a dialogue and a list.
    "Customer: Hi, my order #48213 arrived yesterday but the blender lid is cracked. Can I get "
    "a replacement?\nAgent: I'm sorry to hear that! I can send a new lid today at no cost. "
    "Could you confirm your shipping address?\nCustomer: Sure, it's 17 Elm Street, Apartment "
    "4B, Springfield.\nAgent: Thanks. The replacement should arrive within 3-5 business days. "
    "Is there anything else I can help with?\n\nPancakes for four:\n1. Whisk 2 eggs, 300 ml "
    "milk and 2 tablespoons of melted butter.\n2. Stir in 200 g flour, 1 teaspoon baking "
    "powder and a pinch of salt.\n3. Rest the batter for 10 minutes.\n4. Cook on a hot, "
    "lightly oiled pan for about 1 minute per side.",
    # Abraham Lincoln, the Gettysburg Address (1863).
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now "
    "we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this.",
    # Written for this file: technical and historical prose.
    "The Roman aqueducts carried water across distances of up to 90 kilometres using gravity "
    "alone, with gradients sometimes as gentle as 1 in 4,800. Engineers surveyed the route with "
    "instruments such as the chorobates, a long levelling table, and the groma, used for right "
    "angles. Where valleys interrupted the line, they built arcades of stacked arches, like the "
    "Pont du Gard in southern France, or inverted siphons of lead pipe. Maintenance crews, "
    "organised under a curator aquarum, cleared deposits of calcium carbonate that could "
    "narrow a channel by several centimetres within a few decades.",
    # The United States Declaration of Independence (1776).
    "We hold these truths to be self-evident, that all men are created equal, that they are "
    "endowed by their Creator with certain unalienable Rights, that among these are Life, "
    "Liberty and the pursuit of Happiness. That to secure these rights, Governments are "
    "instituted among Men, deriving their just powers from the consent of the governed, That "
    "whenever any Form of Government becomes destructive of these ends, it is the Right of the "
    "People to alter or to abolish it, and to institute new Government.",
)
